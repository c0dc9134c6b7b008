"""The OpenMP runtime's wait policy, which must be set before torch loads the runtime.

torch's CPU kernels run their parallel regions on an OpenMP pool (GNU libgomp in the Linux
wheels). At the end of each region a thread that has finished its share waits at a barrier
for the others; by default it spins there (up to GOMP_SPINCOUNT iterations, 300,000 unless
the pool outnumbers the cores) before it sleeps. When another process holds one of the cores,
the thread it waits for is not running: the spinning thread burns its own core's time slice
waiting, hundreds of times per decoded token. `OMP_WAIT_POLICY=PASSIVE` makes waiting threads
sleep at once (spin count 0), so the core goes to whoever can use it.

Measured on the 2-core AMD EPYC of docs/benchmarks.md (byte8-shape model, autoregressive
decoding, load average ~6 from other jobs): 2 threads spinning 14-20 tokens/s, 2 threads
passive 226-575 tokens/s, 1 thread 63-132 tokens/s ("Threads on a shared CPU"). With one
thread there is no barrier and the policy changes nothing.

libgomp reads the variable once, when it is loaded, i.e. at `import torch`; so `mtp/__init__`
calls `passive_waits()` before anything imports torch, and a user's own OMP_WAIT_POLICY (or
GOMP_SPINCOUNT) wins. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"


def passive_waits() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user set a policy or spin count, or torch (and
    so its OpenMP runtime) is loaded already; return whether this call set it."""
    if WAIT_POLICY in os.environ or "GOMP_SPINCOUNT" in os.environ or "torch" in sys.modules:
        return False
    os.environ[WAIT_POLICY] = "PASSIVE"
    return True
