"""Speculative generation: the model's heads, a draft model, prompt lookup or lookahead
(Jacobi) decoding draft; head 0 verifies.

`generate(model, tokenizer, prompts, drafter=..., sampling=SamplingConfig(...))` decodes a
batch of prompts; with the heads (the default, sized by k), k = 1 is the autoregressive
baseline and k > 1 blockwise self-speculative decoding. `drafter="auto"` measures the
candidates and keeps the fastest. `python -m mtp.generate` is the command line.
"""

from mtp.generate.auto import Auto
from mtp.generate.combined import Combined
from mtp.generate.decode import generate
from mtp.generate.draft_model import DraftModel
from mtp.generate.drafter import Drafter, Drafts
from mtp.generate.heads_drafter import HeadsDrafter
from mtp.generate.lookahead import Lookahead
from mtp.generate.names import DRAFTERS
from mtp.generate.output import DecodeStats, Generation
from mtp.generate.prompt_lookup import PromptLookup
from mtp.generate.sampling import SamplingConfig

__all__ = ["DRAFTERS", "Auto", "Combined", "DecodeStats", "DraftModel", "Drafter", "Drafts",
           "Generation", "HeadsDrafter", "Lookahead", "PromptLookup", "SamplingConfig", "generate"]
