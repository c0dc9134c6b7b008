"""Decoding on this machine: `open_decoder` (`session.py`), the timing harness (`measure.py`),
the tuning steps saved for a checkpoint (`calibrate.py`, `skip_search.py`, `saved.py`) and
`python -m mtp.generate`; with `mtp.decode`'s public names, so one import serves a user.
"""

from mtp.decode import (Combined, DecodeStats, DraftModel, Drafter, DrafterContext, DrafterSpec,
                        Drafts, EagleDrafter, Generation, HeadsDrafter, LayerSkip, Lookahead,
                        OnlineHeads, PromptLookup, SamplingConfig, SequentialDrafter,
                        TypicalAcceptance, drafter_types, generate)
from mtp.generate.auto import Auto
from mtp.generate.session import Decoder, open_decoder
from mtp.generate.settings import DecodeSettings

__all__ = ["Auto", "Combined", "DecodeSettings", "DecodeStats", "Decoder", "DraftModel",
           "Drafter", "DrafterContext", "DrafterSpec", "Drafts", "EagleDrafter", "Generation",
           "HeadsDrafter", "LayerSkip", "Lookahead", "OnlineHeads", "PromptLookup",
           "SamplingConfig", "SequentialDrafter", "TypicalAcceptance", "drafter_types", "generate",
           "open_decoder"]
