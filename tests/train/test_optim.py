"""The learning-rate schedule: warm-up, then cosine to the end of the step or time budget."""

import math

import pytest
import torch

from mtp.train.optim import LRSchedule, build_scheduler, lr_factor

STEPS = dict(warmup_steps=50, total_steps=400, min_lr_ratio=0.1)


def _step_cosine(step: int) -> float:
    """The step-only schedule, written out by hand."""
    if step < 50:
        return (step + 1) / 50
    progress = min(1.0, (step - 50) / 350)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def test_without_a_time_budget_it_is_warmup_then_cosine() -> None:
    assert lr_factor(0, **STEPS) == pytest.approx(1 / 50)
    assert lr_factor(49, **STEPS) == pytest.approx(1.0)
    assert lr_factor(225, **STEPS) == pytest.approx(0.55)  # halfway down: 0.1 + 0.9 / 2
    assert lr_factor(400, **STEPS) == pytest.approx(0.1)
    assert lr_factor(1000, **STEPS) == pytest.approx(0.1)
    for step in range(0, 420, 7):
        assert lr_factor(step, **STEPS) == pytest.approx(_step_cosine(step), abs=1e-12)


def test_a_machine_on_pace_follows_the_step_schedule_exactly() -> None:
    # 400 steps in 770 s of an 840 s budget: time never leads, so the time term never counts.
    for step in range(0, 400, 5):
        elapsed = 1.925 * step
        assert lr_factor(step, elapsed, time_budget=840, **STEPS) == pytest.approx(
            _step_cosine(step), abs=1e-12)


def test_a_slow_machine_decays_by_the_deadline() -> None:
    # ~5 s per step: the 840 s guard comes at step 168 of 400 (the AVX2 machine of issue 13).
    factors = [lr_factor(step, 5.0 * step, time_budget=840, **STEPS) for step in range(169)]
    assert factors[168] == pytest.approx(0.1)  # the floor, at the deadline
    # Halfway in time: progress 0.5, (0.5 - 50/400) / (1 - 50/400) = 3/7 down the cosine.
    assert factors[84] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 7)))
    decay = factors[50:]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert _step_cosine(168) > 0.75  # what the step-only schedule would still be at


def test_a_deadline_during_warmup_caps_the_ramp() -> None:
    assert lr_factor(10, 840, time_budget=840, **STEPS) == pytest.approx(0.1)
    assert lr_factor(10, 0.0, time_budget=840, **STEPS) == pytest.approx(11 / 50)


def test_per_group_learning_rates_compose_and_state_round_trips() -> None:
    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": weights[:1], "lr": 1.0},
                                 {"params": weights[1:], "lr": 0.1}])
    scheduler = build_scheduler(optimizer, time_budget=100.0, **STEPS)
    schedule = scheduler.lr_lambdas[0]
    for step in range(60):
        schedule.elapsed = 2.0 * step
        optimizer.step()
        scheduler.step()
    expected = lr_factor(60, 118.0, time_budget=100.0, **STEPS)
    assert scheduler.get_last_lr() == pytest.approx([expected, 0.1 * expected])
    restored = build_scheduler(torch.optim.SGD([{"params": weights[:1], "lr": 1.0},
                                                {"params": weights[1:], "lr": 0.1}]),
                               time_budget=100.0, **STEPS)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.lr_lambdas[0] == schedule  # the clock travels with the checkpoint
    assert restored.last_epoch == 60


def test_a_bad_time_budget_is_named() -> None:
    """The steps and ratio are checked as settings (tests/test_configs.py)."""
    with pytest.raises(ValueError, match="time_budget must be > 0"):
        LRSchedule(warmup_steps=1, total_steps=10, time_budget=0.0)
