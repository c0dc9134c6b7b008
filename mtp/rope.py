"""Scaled rotary frequencies: the `rope_scaling` of an MTPConfig (Llama 3.1's, linear), which
`mtp.model.rope_tables` applies through `RopeScaling.frequencies`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from mtp.cli import check_choice, check_number, check_positive

ROPE_SCALINGS: tuple[str, ...] = ("linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Scaled rotary frequencies, as transformers' `rope_type`s of the same names define them:
    `linear` divides every frequency by `factor`; `llama3` (Llama 3.1) keeps wavelengths
    shorter than original_max_seq_len / high_freq_factor, divides those longer than
    original_max_seq_len / low_freq_factor by `factor`, and interpolates between."""

    type: str
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_seq_len: int | None = None  # llama3 only: the context pretraining used

    def __post_init__(self) -> None:
        check_choice("MTPConfig.rope_scaling.type", self.type, ROPE_SCALINGS)
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_seq_len")
        for name in ("factor", *llama3):
            value = getattr(self, name)
            if value is None and (name == "factor" or self.type == "llama3"):
                raise ValueError(f"MTPConfig.rope_scaling.{name} is missing "
                                 f"(type {self.type!r} needs it)")
            if value is not None and self.type == "linear" and name != "factor":
                raise ValueError(f"MTPConfig.rope_scaling.{name} is not a field of type "
                                 f"'linear', got {value!r}")
            if value is not None:
                check_number(f"MTPConfig.rope_scaling.{name}", value, lambda v: v > 0,
                             "a number > 0")
        if self.original_max_seq_len is not None:
            check_positive("MTPConfig.rope_scaling.original_max_seq_len",
                           self.original_max_seq_len)
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"MTPConfig.rope_scaling.high_freq_factor={self.high_freq_factor} "
                             f"must exceed low_freq_factor={self.low_freq_factor}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RopeScaling:
        """A RopeScaling from a mapping of its fields (a config file's), strictly."""
        if unknown := sorted(set(values) - set(cls.field_names())):
            raise ValueError(f"unknown MTPConfig.rope_scaling field(s) {unknown}; known: "
                             f"{cls.field_names()}")
        if "type" not in values or "factor" not in values:
            raise ValueError(f"MTPConfig.rope_scaling needs 'type' and 'factor', got "
                             f"{dict(values)}")
        return cls(**values)

    def frequencies(self, freqs: Tensor) -> Tensor:
        """The scaled rotary frequencies (radians per position) of unscaled `freqs`."""
        if self.type == "linear":
            return freqs / self.factor
        wavelength = 2 * math.pi / freqs
        low, high = self.low_freq_factor, self.high_freq_factor
        smooth = ((self.original_max_seq_len / wavelength - low) / (high - low)).clamp(0, 1)
        # As transformers' _compute_llama3_parameters (the band's ends are 0 and 1).
        return (1 - smooth) * freqs / self.factor + smooth * freqs
