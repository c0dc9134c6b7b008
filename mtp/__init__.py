"""mtp: multi-token prediction pretraining and self-speculative decoding.

Importing mtp first sets `OMP_WAIT_POLICY=PASSIVE` (before torch loads libgomp, which reads it
once), unless the user set it or GOMP_SPINCOUNT. By default a thread done with its share of a
parallel region spins at the barrier, burning its core while another process holds the core
it waits for; passive threads sleep at once. On a 2-core machine at load 6, byte8 decoding
ran 14-20 tokens/s spinning and 226-575 passive (docs/benchmarks.md, "Threads on a shared CPU").
"""

import os as _os
import sys as _sys

if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys() and "torch" not in _sys.modules:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from mtp.checkpoint import export_hf, export_mimo, load  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402

__all__ = ["MTPConfig", "MTPModel", "export_hf", "export_mimo", "load"]
