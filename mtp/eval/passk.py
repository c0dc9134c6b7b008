"""pass@k: the unbiased estimator of Chen et al. 2021, section 2.1: with n samples of which
c pass, 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `n` samples, `c` of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={n}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: Mapping[str, tuple[int, int]], ks: Iterable[int]) -> dict[int, float]:
    """Mean pass@k over problems, `counts` mapping task id to (samples, correct); every
    problem needs at least max(ks) samples (leaving some out would bias the mean)."""
    if not counts:
        raise ValueError("pass@k of no problems is undefined")
    ks = sorted(set(ks))
    check_ks(ks, min(n for n, _ in counts.values()))
    return {k: sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts) for k in ks}


def check_ks(ks: Sequence[int], samples: int) -> None:
    """Fail early unless every k can be estimated from `samples` samples per problem."""
    if not ks or any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"k={list(ks)}: every k must lie in 1..{samples} (samples per problem)")
