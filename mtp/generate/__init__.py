"""Generating text from a checkpoint on this machine: `open_decoder` opens a checkpoint for
decoding with every choice measured on the model that will decode (`session.py`: the
drafter, `auto.py`; the dtype and the threads), the one timing harness (`measure.py`), the
tuning steps that save choices for a checkpoint (`calibrate.py`: the heads' trees,
`skip_search.py`: layer skipping), and the command line `python -m mtp.generate`.

The public names of `mtp.decode`, the algorithm, are here too, so `from mtp.generate import
generate, HeadsDrafter` is the one import a user needs.
"""

from mtp.decode import (Combined, DecodeStats, DraftModel, Drafter, DrafterContext, DrafterSpec,
                        Drafts, EagleDrafter, Generation, HeadsDrafter, LayerSkip, Lookahead, OnlineHeads,
                        PromptLookup, SamplingConfig, SequentialDrafter, TypicalAcceptance,
                        drafter_types, generate)
from mtp.generate.auto import Auto
from mtp.generate.session import DecodeSettings, Decoder, open_decoder

__all__ = ["Auto", "Combined", "DecodeSettings", "DecodeStats", "Decoder", "DraftModel",
           "Drafter", "DrafterContext", "DrafterSpec", "Drafts", "EagleDrafter", "Generation", "HeadsDrafter",
           "LayerSkip", "Lookahead", "OnlineHeads", "PromptLookup", "SamplingConfig",
           "SequentialDrafter", "TypicalAcceptance", "drafter_types", "generate",
           "open_decoder"]
