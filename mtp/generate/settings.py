"""How to decode: `DecodeSettings`, the keys of `python -m mtp.generate` and of eval, built and
checked once, then passed whole to `open_decoder` (`session.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mtp.cli import AUTO, check_flag, check_number, parse_dtype
from mtp.decode.acceptance import acceptance_rule
from mtp.decode.drafters.base import Drafter
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.loop import check_exact
from mtp.decode.sampling import SamplingConfig
from mtp.generate.measure import step_width
from mtp.tune import check_threads

AUTO_SECONDS = 30.0  # the most `drafter=auto` measures, unless the caller says otherwise


@dataclass(frozen=True, kw_only=True)
class DecodeSettings:
    """How to decode: the drafter (`options`: its options, as the command lines take them)
    and every choice around it, checked once; the keys of `python -m mtp.generate` (its
    docstring says what each means) and of eval."""

    drafter: str = AUTO
    options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str | None = None
    threads: int | str | None = AUTO
    compile: bool | None = None
    acceptance: str = "exact"
    exact: bool | str = False  # the command lines' default: auto
    width: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    budget: float = AUTO_SECONDS
    kernels: bool = True  # decode through mtp.kernels on a CPU (False: through torch)

    def __post_init__(self) -> None:
        _ = self.spec, self.sampling  # parsed here so bad options fail before anything loads
        check_flag("kernels", self.kernels)
        parse_dtype(self.dtype, auto=True)
        if isinstance(self.exact, str) and self.exact != AUTO:
            raise ValueError(f"exact must be true, false or auto, got {self.exact!r}")
        rule = acceptance_rule(self.acceptance)
        if self.exact == AUTO:  # chosen when the decoder opens: a width must fit then
            check_exact(True, self.width, None)
        else:
            check_exact(self.exact, self.width, rule)
        check_threads(self.threads)
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device={self.device!r}: {error}") from None
        check_number("budget", self.budget, lambda v: v > 0, "> 0 seconds")

    @property
    def spec(self) -> DrafterSpec:
        return DrafterSpec(self.drafter, **self.options)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def compiled(self) -> bool:
        """Whether the decode step is compiled: as asked, else on a GPU only."""
        on_gpu = torch.device(self.device).type == "cuda"
        return on_gpu if self.compile is None else bool(self.compile)

    def step_width(self, drafter: Drafter | None) -> int:
        """Tokens per row a step of `drafter` forwards: exact mode's width, or its own."""
        return self.width if self.exact is True and self.width else step_width(drafter)

    def generate_options(self, drafter: Drafter | None) -> dict[str, Any]:
        """`mtp.decode.generate`'s keyword arguments for decoding with `drafter` (exact=auto
        not yet chosen: the plain step)."""
        exact = self.exact is True
        return {"drafter": drafter, "sampling": self.sampling, "acceptance": self.acceptance,
                "compile": self.compiled, "exact": exact, "width": self.width if exact else None}

    @property
    def load_dtype(self) -> torch.dtype | None:
        """The dtype to load in: the one named; float32 when measured; else bfloat16 on a GPU,
        the checkpoint's own on a CPU."""
        if self.dtype == AUTO:
            return torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16
        if self.dtype is None and torch.device(self.device).type == "cuda":
            return torch.bfloat16
        return parse_dtype(self.dtype)
