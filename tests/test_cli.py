"""The one kit of value checks (`mtp.cli.check_*`): settings, drafter options and
`MTPConfig` refuse a bad value in one line, `key=value must be ...`."""

from __future__ import annotations

import re
from types import SimpleNamespace as _Keys  # settings as attributes, as a dataclass holds them

import pytest

from mtp.cli import (check_choice, check_choices, check_flag, check_number, check_numbers,
                     check_positive, check_positives)


def test_good_values_come_back_in_their_type() -> None:
    assert check_positive("k", 3) == 3 and check_positive("guesses", 0, least=0) == 0
    assert check_flag("exact", False) is False
    number = check_number("lr", 2, lambda v: v > 0, "> 0")
    assert number == 2.0 and isinstance(number, float)
    assert check_numbers("betas", [0.9, 0.95], lambda v: 0 <= v < 1, "two", length=2) == (0.9, 0.95)
    assert check_choice("mode", "naive", ("naive", "headwise")) == "naive"
    check_positives(_Keys(k=2, limit=None, offset=0), "k", "limit", optional=True)
    check_positives(_Keys(offset=0), "offset", least=0)


@pytest.mark.parametrize(("check", "message"), [
    (lambda: check_positive("num_draft", 0), "num_draft=0 must be a positive integer"),
    (lambda: check_positive("n_future", True), "n_future=True must be a positive integer"),
    (lambda: check_positive("width", 2.0), "width=2.0 must be a positive integer"),
    (lambda: check_positive("window", 1, least=2), "window=1 must be an integer >= 2"),
    (lambda: check_positive("steps", -1, 0, "a step count"), "steps=-1 must be a step count"),
    (lambda: check_positives(_Keys(steps=2, window=0), "steps", "window"),
     "window=0 must be a positive integer"),
    (lambda: check_positives(_Keys(limit=None), "limit"), "limit=None must be a positive integer"),
    (lambda: check_positives(_Keys(offset=-1), "offset", least=0, optional=True),
     "offset=-1 must be an integer >= 0"),
    (lambda: check_flag("chat", "yes"), "chat='yes' must be true or false"),
    (lambda: check_flag("chat", 1), "chat=1 must be true or false"),
    (lambda: check_number("lr", -1, lambda v: v > 0, "> 0"), "lr=-1.0 must be > 0"),
    (lambda: check_number("lr", float("nan")), "lr=nan must be a finite number"),
    (lambda: check_number("lr", "1e-3"), "lr='1e-3' must be a finite number"),
    (lambda: check_number("lr", False), "lr=False must be a finite number"),
    (lambda: check_numbers("betas", [0.9, 1.5], lambda v: v < 1, "two numbers in [0, 1)"),
     "betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    (lambda: check_numbers("betas", [0.9], lambda v: v < 1, "two numbers", length=2),
     "betas=[0.9] must be two numbers"),
    (lambda: check_choice("mode", "fast", ("naive", "headwise"), "or null"),
     "mode='fast' is not one of naive, headwise (or null)"),
    (lambda: check_choice("compile", "often", (False, True, "both")),
     "compile='often' is not one of false, true, both"),
    (lambda: check_choices("levels", ["cpu", "gvisor"], ("cpu", "process")),
     "levels: 'gvisor' is not one of cpu, process"),
])
def test_a_bad_value_is_one_line_naming_key_and_value(check, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check()
