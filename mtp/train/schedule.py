"""How far a run is, and how the loss weights of the terms beyond the next token move with it.

A multi-token loss has the next-token term (head 0 against token t + 1) and terms at a
*distance* d = 1..K beyond it: head d, which predicts token t + d + 1, and, with `loss.ahead`,
head 0's own logits scored against token t + d + 1 (modded-nanogpt's single-head loss). A
schedule multiplies the base weight of every term at distance d by a factor m_d(p) of the
run's progress p in [0, 1]:

    constant  m_d = 1                                   (the paper's sum; the default)
    stepped   m_d = 1 before the switch s, then `factor` (DeepSeek-V3: 0.3, then 0.1)
    anneal    from 1 to 0 over the window [a, b], the farthest term first: the window is cut
              into K equal slices and distance d falls linearly in slice K - d (counting from
              0), so after b the loss is next-token prediction alone (the reverse curriculum;
              modded-nanogpt's [1, 0.5, 0.25 -> 0] -> [1, 0.5 -> 0] -> [1] is K = 2, window
              [0, 2/3])
    ramp      the mirror image: from 0 to 1 over [a, b], the nearest term first: distance d
              rises in slice d - 1 (the forward curriculum)

Progress is the learning-rate schedule's (`mtp.train.optim.lr_factor`): p = max(step /
max_steps, elapsed / time_budget), so a run that `trainer.max_time` ends early ends its weight
schedule by then too. A schedule's points are optimizer steps of `trainer.max_steps`
(`loss.schedule_steps`), i.e. the progress step / max_steps. Worked example, anneal over the
whole run of 400 steps with K = 2: at step 100 (p = 0.25) distance 2 is half-way down its
slice [0, 0.5] (m_2 = 0.5) and distance 1 has not started (m_1 = 1); at step 300 (p = 0.75)
m_2 = 0 and m_1 = 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES: tuple[str, ...] = ("constant", "stepped", "anneal", "ramp")


def run_progress(step: int, total_steps: int, elapsed: float = 0.0,
                 time_budget: float | None = None) -> float:
    """max(step / total_steps, elapsed / time_budget): how far a run is through its budget of
    steps or of time, whichever it spends faster (not clipped to 1)."""
    progress = step / total_steps
    if time_budget is not None:
        progress = max(progress, elapsed / time_budget)
    return progress


@dataclass(frozen=True)
class Progress:
    """Where a run is: optimizer step `step` of `max_steps`, `elapsed` seconds of its
    `time_budget` (None: no time budget). The default is a run's start."""

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
    """m_1..m_levels (module docstring) at `progress`; `window` is the stepped schedule's
    switch (its first value) or the anneal's and ramp's [a, b]; `factor` the stepped one's."""
    if schedule == "constant":
        return (1.0,) * levels
    if schedule == "stepped":
        return (1.0 if progress < window[0] else factor,) * levels
    if schedule not in ("anneal", "ramp"):
        raise ValueError(f"loss.schedule={schedule!r} is not one of {SCHEDULES}")
    start, end = window
    width = (end - start) / levels
    factors = []
    for distance in range(1, levels + 1):
        turn = levels - distance if schedule == "anneal" else distance - 1
        risen = min(1.0, max(0.0, (progress - start - turn * width) / width))
        factors.append(1.0 - risen if schedule == "anneal" else risen)
    return tuple(factors)
