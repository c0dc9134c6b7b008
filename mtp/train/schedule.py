"""How far a run is, and how the loss weights of the terms beyond the next token move with it.

A term at *distance* d = 1..K beyond the next token (head d, or with `loss.ahead` head 0
scored against token t + d + 1) has its base weight multiplied by m_d(p), p the run's
progress in [0, 1]:

    constant  m_d = 1                                   (the paper's sum; the default)
    stepped   m_d = 1 before the switch s, then `factor` (DeepSeek-V3: 0.3, then 0.1)
    anneal    from 1 to 0 over the window [a, b], the farthest term first: distance d falls
              linearly in slice K - d (from 0) of K equal slices, so after b the loss is
              next-token alone (modded-nanogpt's reverse curriculum)
    ramp      the mirror image: from 0 to 1, the nearest term first (distance d rises in
              slice d - 1)

Progress is the learning rate's (`mtp.train.optim.lr_factor`); `loss.schedule_steps` are
optimizer steps. E.g. anneal over 400 steps, K = 2: at step 100, m_2 = 0.5, m_1 = 1; at step
300, m_2 = 0, m_1 = 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtp.cli import check_choice

SCHEDULES: tuple[str, ...] = ("constant", "stepped", "anneal", "ramp")


def run_progress(step: int, total_steps: int, elapsed: float = 0.0,
                 time_budget: float | None = None) -> float:
    """max(step / total_steps, elapsed / time_budget), not clipped to 1."""
    if time_budget is None:
        return step / total_steps
    return max(step / total_steps, elapsed / time_budget)


@dataclass(frozen=True)
class Progress:
    """Where a run is: optimizer step `step` of `max_steps`, `elapsed` seconds of its
    `time_budget` (None: none). The default is a run's start."""

    step: int = 0
    max_steps: int = 1
    elapsed: float = 0.0
    time_budget: float | None = None

    @property
    def fraction(self) -> float:
        return run_progress(self.step, self.max_steps, self.elapsed, self.time_budget)

    def of(self, step: int) -> float:
        """The progress at which this run reaches optimizer step `step`."""
        return step / self.max_steps


def distance_factors(schedule: str, levels: int, progress: float, *,
                     window: tuple[float, float] = (0.0, 1.0),
                     factor: float = 1.0) -> tuple[float, ...]:
    """m_1..m_levels at `progress`; `window`: stepped's switch (first value) or anneal's and
    ramp's [a, b]; `factor`: stepped's."""
    if schedule == "constant":
        return (1.0,) * levels
    if schedule == "stepped":
        return (1.0 if progress < window[0] else factor,) * levels
    check_choice("loss.schedule", schedule, SCHEDULES)
    start, end = window
    width = (end - start) / levels
    factors = []
    for distance in range(1, levels + 1):
        turn = levels - distance if schedule == "anneal" else distance - 1
        risen = min(1.0, max(0.0, (progress - start - turn * width) / width))
        factors.append(1.0 - risen if schedule == "anneal" else risen)
    return tuple(factors)
