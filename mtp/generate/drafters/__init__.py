"""Drafters: who proposes tokens, apart from who verifies them (`base.py` is the seam).

`heads.py` (the model's parallel heads), `sequential.py` (sequential modules, DeepSeek-V3's
MTP), `draft_model.py`, `layer_skip.py` (the model itself with layers skipped),
`prompt_lookup.py`, `lookahead.py` (Jacobi iteration and an n-gram pool), `combined.py`
(several drafters, the longest draft per sequence) and `online.py` (heads that learn while
they draft);
`mtp.generate.spec` builds them from names and options.
"""

from mtp.generate.drafters.base import Drafter, Drafts, Verified
from mtp.generate.drafters.combined import Combined
from mtp.generate.drafters.draft_model import DraftModel
from mtp.generate.drafters.heads import HeadsDrafter, OwnHeads
from mtp.generate.drafters.layer_skip import LayerSkip
from mtp.generate.drafters.lookahead import Lookahead
from mtp.generate.drafters.online import OnlineHeads
from mtp.generate.drafters.prompt_lookup import PromptLookup
from mtp.generate.drafters.sequential import SequentialDrafter

__all__ = ["Combined", "DraftModel", "Drafter", "Drafts", "HeadsDrafter", "LayerSkip",
           "Lookahead", "OnlineHeads", "OwnHeads", "PromptLookup", "SequentialDrafter", "Verified"]
