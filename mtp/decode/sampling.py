"""Logits to a next-token distribution (`probabilities`: temperature, top-k, top-p) and one
draw from it (`sample`), the one pair every decoder uses. Greedy is temperature 0: a one-hot
distribution, so acceptance treats greedy and sampling alike. Exact mode draws by
`inverse_cdf` with one uniform per sequence and position (`position_uniforms`), so a
position's token is the same whichever step computes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How a token is chosen from head 0's logits (and the drafts from the other heads');
    `greedy` (temperature 0) is a plain attribute, set once: every step reads it."""

    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # keep the k most likely tokens; None: all
    top_p: float = 1.0  # keep the smallest set of tokens with this much probability mass
    greedy: bool = field(init=False, repr=False, compare=False)  # temperature 0, set below

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int)
                                       or isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "greedy", self.temperature == 0)


def probabilities(logits: Tensor, config: SamplingConfig) -> Tensor:
    """The distribution (..., V) that `config` samples from, given logits (..., V), in
    float32 at least (float64 logits stay float64, as the exactness tests use)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if config.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if config.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = cumulative - sorted_logits.softmax(-1) >= config.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.softmax(-1)


def exponential(shape: tuple[int, ...], generator: torch.Generator | None,
                device: torch.device | str) -> Tensor:
    """Exp(1) draws of `shape` in float32: the noise `sample` turns into tokens."""
    return torch.empty(shape, device=device).exponential_(generator=generator)


def sample(probs: Tensor, noise: Tensor) -> Tensor:
    """One token per row of `probs` (..., V) given Exp(1) `noise` of that shape: argmax(p / E)
    is a draw from p (unnormalised too) with no cumulative sums and no host read, and noise
    drawn before a step lets a captured step replay exactly."""
    return (probs / noise).argmax(-1)


_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_uniforms(seed: int, rows: Sequence[int], positions: Sequence[Sequence[int]],
                      device: torch.device | str) -> Tensor:
    """One uniform in [0, 1) for each row's `positions` (B, m): a hash of (seed, the row's
    sequence number `rows[b]`, the position), so every step that draws a position's token
    draws it with the same number."""
    values = [[_mix(_mix(_mix(seed) ^ row) ^ position) / 2 ** 64 for position in row_positions]
              for row, row_positions in zip(rows, positions)]
    return torch.tensor(values, dtype=torch.float64, device=device)


def inverse_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """The token (...) whose cumulative probability first exceeds `uniform` (...) times the
    total of `probs` (..., V): a draw from `probs` that depends on the row alone."""
    cumulative = probs.cumsum(-1)
    threshold = uniform.to(cumulative.dtype)[..., None] * cumulative[..., -1:]
    token = torch.searchsorted(cumulative.contiguous(), threshold, right=True)[..., 0]
    return token.clamp(max=probs.shape[-1] - 1)
