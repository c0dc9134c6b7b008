"""Translation layers between mtp checkpoints and other libraries' layouts: `hf`
(transformers' Llama and Qwen2, both ways), `mimo` (MiMo's and DeepSeek's MTP modules),
`medusa` (vLLM's and FasterDecoding's Medusa heads, both ways), `meta` (Meta's
multi-token-prediction release) and `gguf` (llama.cpp's files; `gguf_tokenizer`).

Each reader returns `(MTPConfig, state dict in mtp's names, Tokenizer)` for
`mtp.checkpoint.load`; the `.[hf]` extra is imported only to read a SentencePiece or GGUF file.
"""
