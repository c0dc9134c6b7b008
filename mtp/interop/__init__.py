"""Translation layers between mtp checkpoints and other libraries' layouts: `hf`
(transformers' Llama and Qwen2, both ways), `mimo` (MiMo's and DeepSeek's MTP modules),
`medusa` (vLLM's and FasterDecoding's Medusa heads, both ways), `meta` (Meta's
multi-token-prediction release) and `gguf` (llama.cpp's files; `gguf_tokenizer`).

Each reader returns `(MTPConfig, state dict in mtp's names, Tokenizer)`, from which
`mtp.checkpoint.load` builds the model. transformers, sentencepiece and gguf (the `.[hf]`
extra) are imported only where a SentencePiece model or a GGUF is read.
"""
