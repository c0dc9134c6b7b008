"""Translation layers between mtp checkpoints and other libraries' layouts: `hf` (transformers'
Llama and Qwen2), `mimo` (MiMo's and DeepSeek's MTP modules), `medusa`, `eagle3`, `meta` (Meta's
multi-token-prediction release) and `gguf` (llama.cpp's). Each reader returns `(MTPConfig, state
dict in mtp's names, Tokenizer)` for `mtp.checkpoint.load`; the `.[hf]` extra is imported only
to read a SentencePiece or GGUF file.
"""
