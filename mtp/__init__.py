"""mtp: multi-token prediction pretraining and self-speculative decoding.

Importing mtp first sets OpenMP's wait policy, which must happen before torch loads its
OpenMP runtime (GNU libgomp reads it once, at `import torch`). At the end of each parallel
region a thread that has finished its share waits at a barrier for the others, and by
default spins there (up to GOMP_SPINCOUNT iterations) before it sleeps. When another process
holds one of the cores, the thread it waits for is not running: the spinning thread burns
its own core's time slice, hundreds of times per decoded token. `OMP_WAIT_POLICY=PASSIVE`
makes waiting threads sleep at once, so the core goes to whoever can use it: on a 2-core
machine at load 6, byte8-shape autoregressive decoding ran 14-20 tokens/s with 2 spinning
threads and 226-575 with 2 passive ones (docs/benchmarks.md, "Threads on a shared CPU"). A
user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

import os as _os
import sys as _sys

if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys() and "torch" not in _sys.modules:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from mtp.checkpoint import export_hf, export_mimo, load  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402

__all__ = ["MTPConfig", "MTPModel", "export_hf", "export_mimo", "load"]
