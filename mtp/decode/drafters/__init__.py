"""Drafters: who proposes tokens, apart from who verifies them (`base.py` is the seam). Each
module is one drafter that registers itself by name (`registry.py`)."""

from mtp.decode.drafters.base import Drafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.combined import Combined
from mtp.decode.drafters.draft_model import DraftModel
from mtp.decode.drafters.eagle import EagleDrafter
from mtp.decode.drafters.heads import HeadsDrafter, OwnHeads
from mtp.decode.drafters.layer_skip import LayerSkip
from mtp.decode.drafters.lookahead import Lookahead
from mtp.decode.drafters.online import OnlineHeads
from mtp.decode.drafters.prompt_lookup import PromptLookup
from mtp.decode.drafters.registry import DrafterSpec, drafter_types, make_drafter
from mtp.decode.drafters.sequential import SequentialDrafter

__all__ = ["Combined", "DraftModel", "Drafter", "DrafterContext", "DrafterSpec", "Drafts",
           "EagleDrafter", "HeadsDrafter", "LayerSkip", "Lookahead", "OnlineHeads", "OwnHeads",
           "PromptLookup", "SequentialDrafter", "Verified", "drafter_types", "make_drafter"]
