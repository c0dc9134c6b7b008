"""Self-speculative generation with the multi-token heads.

`generate(model, tokenizer, prompts, k=..., sampling=SamplingConfig(...))` decodes a batch of
prompts; k = 1 is the autoregressive baseline, k > 1 blockwise self-speculative decoding
(`speculative.py`). `python -m mtp.generate` is the command line.
"""

from mtp.generate.decode import generate
from mtp.generate.output import DecodeStats, Generation
from mtp.generate.sampling import SamplingConfig

__all__ = ["DecodeStats", "Generation", "SamplingConfig", "generate"]
