"""Generating text from a checkpoint on this machine: the decoding of `mtp.decode`, with its
choices measured (`auto`: the fastest drafter), and the command line `python -m mtp.generate`.

The public names of `mtp.decode` are here too, so `from mtp.generate import generate,
HeadsDrafter` is the one import a user needs.
"""

from mtp.decode import (DRAFTERS, Combined, DecodeStats, DraftModel, Drafter, DrafterSpec,
                        Drafts, Generation, HeadsDrafter, LayerSkip, Lookahead, OnlineHeads,
                        PromptLookup, SamplingConfig, SequentialDrafter, TypicalAcceptance,
                        generate)
from mtp.generate.auto import Auto, choose_drafter

__all__ = ["DRAFTERS", "Auto", "Combined", "DecodeStats", "DraftModel", "Drafter", "DrafterSpec",
           "Drafts", "Generation", "HeadsDrafter", "LayerSkip", "Lookahead", "OnlineHeads",
           "PromptLookup", "SamplingConfig", "SequentialDrafter", "TypicalAcceptance",
           "choose_drafter", "generate"]
