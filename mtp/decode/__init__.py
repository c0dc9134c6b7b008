"""Speculative decoding, the algorithm: a drafter proposes (`drafters/`), head 0 verifies in
one forward pass of fixed shapes (`engine.py`, `forward.py`), the acceptance rule keeps a
path (`acceptance.py`), the loop commits it (`loop.py`: `generate`). Nothing here measures,
reads files or parses a command line: that is `mtp.generate`'s.
"""

from mtp.decode.acceptance import TypicalAcceptance
from mtp.decode.drafters import (Combined, DraftModel, Drafter, DrafterContext, DrafterSpec,
                                 Drafts, EagleDrafter, HeadsDrafter, LayerSkip, Lookahead,
                                 OnlineHeads, PromptLookup, SequentialDrafter, drafter_types)
from mtp.decode.loop import generate
from mtp.decode.output import DecodeStats, Generation
from mtp.decode.sampling import SamplingConfig

__all__ = ["Combined", "DecodeStats", "DraftModel", "Drafter", "DrafterContext", "DrafterSpec",
           "Drafts", "EagleDrafter", "Generation", "HeadsDrafter", "LayerSkip", "Lookahead",
           "OnlineHeads", "PromptLookup", "SamplingConfig", "SequentialDrafter",
           "TypicalAcceptance", "drafter_types", "generate"]
