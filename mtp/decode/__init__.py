"""Speculative decoding, the algorithm: a drafter proposes, head 0 verifies in one forward
pass of fixed shapes, the acceptance rule keeps a path, the loop commits it.

`generate(model, tokenizer, prompts, drafter=..., sampling=SamplingConfig(...))` decodes a
batch of prompts: with no drafter autoregressively (the baseline), with `HeadsDrafter(k)`
by blockwise self-speculative decoding (heads 1..k-1 draft), and so on (`drafters/`).
Nothing here measures, reads files or parses a command line: opening a checkpoint for
decoding, choosing by measurement and the command line are `mtp.generate`'s.

    loop.py        generate(): draft -> verify -> accept -> commit, stopping and streaming
    engine.py      the decode step on the device: verify, accept, compact the cache
    forward.py     cached forward passes: the trunk and heads over new tokens
    acceptance.py  which drafted path a forward keeps, and the token after it
    sampling.py    logits to a next-token distribution, and one draw from it
    tree.py        candidate trees and their buffers
    output.py      what a generation returns
    drafters/      who proposes: the heads, a draft model, prompt lookup, lookahead, ...
"""

from mtp.decode.acceptance import TypicalAcceptance
from mtp.decode.drafters import (Combined, DraftModel, Drafter, DrafterContext, DrafterSpec,
                                 Drafts, EagleDrafter, HeadsDrafter, LayerSkip, Lookahead, OnlineHeads,
                                 PromptLookup, SequentialDrafter, drafter_types)
from mtp.decode.loop import generate
from mtp.decode.output import DecodeStats, Generation
from mtp.decode.sampling import SamplingConfig

__all__ = ["Combined", "DecodeStats", "DraftModel", "Drafter", "DrafterContext", "DrafterSpec",
           "Drafts", "EagleDrafter", "Generation", "HeadsDrafter", "LayerSkip", "Lookahead", "OnlineHeads",
           "PromptLookup", "SamplingConfig", "SequentialDrafter", "TypicalAcceptance",
           "drafter_types", "generate"]
