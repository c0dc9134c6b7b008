"""Translation layers between mtp checkpoints and other libraries' layouts.

- `hf`: Hugging Face transformers' Llama (`LlamaForCausalLM` directories, and Qwen2's), both
  ways, plus mtp's heads file beside it for heads 1..n-1.
- `meta`: Meta's multi-token-prediction release (params.json + consolidated.pth +
  tokenizer.model), import only.
- `medusa`: `medusa` heads as Medusa heads for vLLM and FasterDecoding / TensorRT-LLM, with
  the base model as a Hugging Face Llama directory, both ways.
- `gguf`: llama.cpp's GGUF files of Llama-architecture models, import only, their tokenizer
  rebuilt from the metadata by `gguf_tokenizer`.

Each reader returns `(MTPConfig, state dict in mtp's names, Tokenizer)`; `mtp.checkpoint.load`
dispatches between layouts and builds the model once, the same way for all of them.
No module imports transformers, sentencepiece or gguf at import time: only converting a
SentencePiece `tokenizer.model` or reading a GGUF needs them (the `.[hf]` extra).
"""
