"""Speculative generation: the model's heads, a draft model, the model with layers skipped,
prompt lookup or lookahead (Jacobi) decoding draft; head 0 verifies, in a decode step of
fixed shapes (`engine.py`).

`generate(model, tokenizer, prompts, drafter=..., sampling=SamplingConfig(...))` decodes a
batch of prompts: with no drafter autoregressively (the baseline), with `HeadsDrafter(k)`
by blockwise self-speculative decoding (heads 1..k-1 draft), and so on. `compile=True` runs
the step compiled (CUDA graphs on a GPU). `choose_drafter` (or `Auto`) measures candidate
drafters first and keeps the fastest. `python -m mtp.generate` is the command line.
"""

from mtp.generate.acceptance import TypicalAcceptance
from mtp.generate.auto import Auto, choose_drafter
from mtp.generate.decode import generate
from mtp.generate.drafters import (Combined, DraftModel, Drafter, Drafts, HeadsDrafter,
                                   LayerSkip, Lookahead, OnlineHeads, PromptLookup,
                                   SequentialDrafter)
from mtp.generate.output import DecodeStats, Generation
from mtp.generate.sampling import SamplingConfig
from mtp.generate.spec import DRAFTERS, DrafterSpec

__all__ = ["DRAFTERS", "Auto", "Combined", "DecodeStats", "DraftModel", "Drafter", "DrafterSpec",
           "Drafts", "Generation", "HeadsDrafter", "LayerSkip", "Lookahead", "OnlineHeads",
           "PromptLookup",
           "SamplingConfig", "SequentialDrafter", "TypicalAcceptance", "choose_drafter",
           "generate"]
