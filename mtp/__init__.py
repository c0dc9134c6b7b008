"""mtp: multi-token prediction pretraining and self-speculative decoding.

Importing mtp first sets `OMP_WAIT_POLICY=PASSIVE` (before torch loads libgomp), unless the
user set it or GOMP_SPINCOUNT: spinning threads burn cores another process needs; on a busy
2-core machine byte8 decoding ran 14-20 tokens/s spinning, 226-575 passive (docs/benchmarks.md).
"""

import os as _os
import sys as _sys

if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys() and "torch" not in _sys.modules:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from mtp.checkpoint import export_hf, export_mimo, load  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402

__all__ = ["MTPConfig", "MTPModel", "export_hf", "export_mimo", "load"]
