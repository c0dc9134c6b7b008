"""`drafter=auto` / `k=auto`: measure candidate drafters on the first prompts, keep the fastest.

Which drafter pays depends on the model, the text, the batch, sampling and the machine, so
each candidate (`Drafter.candidates`; `k=auto`: the heads' chains) decodes the call's prompts
for `tokens` new tokens on the model as it will decode (`prepare`: its dtype and threads);
the leaders decode again, the better tokens/s counting. Another drafter must beat
autoregressive decoding by `margin`. The measurement takes at most `SHARE` of the run's
autoregressive time (`planned_tokens`) and `budget` seconds, a compiled warm-up not counted;
what it left out is recorded, so a run that plans more tokens measures again. The record (a
`mtp.tune.Measurement`) is cached under everything the choice depends on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mtp.cli import check_number, check_positive
from mtp.decode.drafters.base import Drafter, DrafterContext
from mtp.decode.drafters.registry import AUTO, AUTOREGRESSIVE, DrafterSpec
from mtp.decode.output import Generation
from mtp.decode.sampling import SamplingConfig
from mtp.generate.measure import time_generate
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer
from mtp.tune import Measurement, TuneCache, fingerprint, tune, tune_key

Prepare = Callable[[Drafter | None], MTPModel]
SHARE = 0.1  # of the planned tokens' autoregressive time, the most the measurement takes


@dataclass
class Auto:
    """Chooses the fastest drafter by measurement (see the module docstring)."""

    spec: DrafterSpec = field(default_factory=lambda: DrafterSpec(AUTO))
    context: DrafterContext = field(default_factory=DrafterContext)
    compile: bool = False  # measure (and later decode) with the compiled step
    exact: bool = False  # ... in exact mode, every step `width` wide (None: each drafter's own)
    width: int | None = None
    tokens: int = 64  # new tokens per measurement
    margin: float = 1.03  # a drafter must beat autoregressive decoding by this factor
    finalists: int = 3  # candidates measured a second time (with autoregressive decoding)
    budget: float | None = None  # seconds the measurement may take at most (None: no limit)
    planned_tokens: int | None = None  # new tokens the run will decode (bounds the budget)
    model_id: str | None = None  # the checkpoint's identity: None caches nothing
    cache: TuneCache | None = None
    record: Measurement | None = None  # the last choice's

    def __post_init__(self) -> None:
        check_positive("tokens", self.tokens)
        check_positive("finalists", self.finalists)
        check_number("margin", self.margin, lambda v: v >= 1, ">= 1")
        if self.budget is not None:
            check_number("budget", self.budget, lambda v: v > 0, "> 0 seconds (or None)")
        if not self.spec.measured:
            raise ValueError(f"{self.spec} names a drafter: nothing to measure")

    @property
    def choice(self) -> str | None:
        return self.record.choice if self.record else None

    def candidates(self, model: MTPModel,
                   measured: dict[str, float]) -> dict[str, Drafter | None]:
        """Label -> drafter (None: autoregressive): every candidate the spec measures, in
        order."""
        return {AUTOREGRESSIVE: None, **dict(self._candidates(model, measured))}

    def _candidates(self, model: MTPModel,
                    measured: dict[str, float]) -> Iterator[tuple[str, Drafter]]:
        """Each candidate once, by label, that fits an exact step of `width`; a drafter's own
        may depend on those `measured` before it (read when the iteration reaches it)."""
        seen = {AUTOREGRESSIVE}
        for name in self.spec.measured_drafters:
            for drafter in self.spec.candidates(model, self.context, measured, name):
                label = repr(drafter)
                if label not in seen and (self.width is None
                                          or drafter.tree.n_nodes <= self.width):
                    seen.add(label)
                    yield label, drafter

    def choose(self, model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
               sampling: SamplingConfig, max_new_tokens: int, batch_size: int | None = None,
               prepare: Prepare | None = None) -> Drafter | None:
        """The fastest drafter for these prompts (None: autoregressive decoding), measured in
        batches of `batch_size` (default: all at once); `prepare(drafter)`: the model as it
        decodes with that drafter (default: `model`)."""
        batch_size = len(prompts) if batch_size is None else check_positive(
            "batch_size", batch_size)
        prepare = prepare or (lambda drafter: model)
        key = self._key(model, batch_size, sampling)
        self.record = tune("drafter", key, lambda: self._measure(
            model, tokenizer, prompts, batch_size, sampling, max_new_tokens, prepare),
            cache=self.cache, usable=lambda found: self._usable(model, found))
        label, figures = self.record.choice, self.record.figures
        return None if label == AUTOREGRESSIVE else self.candidates(model, figures)[label]

    def _usable(self, model: MTPModel, found: Measurement) -> bool:
        """Whether a cached choice serves: not cut short by a budget for a run that plans
        more tokens, and its drafter still a candidate."""
        planned = (found.value or {}).get("planned_tokens") or 0
        if found.left_out and (self.planned_tokens or 0) > planned:
            return False
        label = found.choice
        return label == AUTOREGRESSIVE or label in self.candidates(model, found.figures)

    def _measure(self, model: MTPModel, tokenizer: Tokenizer, prompts: list[str],
                 batch_size: int, sampling: SamplingConfig, max_new_tokens: int,
                 prepare: Prepare) -> Measurement:
        tokens = min(self.tokens, max_new_tokens)
        began, limit = time.perf_counter(), self.budget
        # A compiled candidate's untimed warm-up compiles its step (8.7 s of a 5.6 s budget on
        # an H100), paid once whichever it keeps: the budget counts the timed decoding only.
        compiling = 0.0

        def time_left() -> bool:
            return limit is None or time.perf_counter() - began - compiling < limit

        def speed(drafter: Drafter | None, first: bool = False) -> float:
            called, compiled_before = time.perf_counter(), compiling

            def go_on(seconds: float, done: list[Generation]) -> bool:
                nonlocal compiling, limit
                if self.compile:  # all but the timed `seconds` of this call was its warm-up
                    compiling = compiled_before + time.perf_counter() - called - seconds
                if first and self.planned_tokens is not None:  # at most SHARE of the run
                    rate = sum(g.stats.new_tokens for g in done) / seconds
                    share = SHARE * self.planned_tokens / rate
                    limit = share if self.budget is None else min(self.budget, share)
                return time_left()  # one batch at least

            return time_generate(
                prepare(drafter), tokenizer, prompts, max_new_tokens=tokens,
                batch_size=batch_size, seed=0, warmup_tokens=2, go_on=go_on, drafter=drafter,
                sampling=sampling, compile=self.compile, exact=self.exact,
                width=self.width).tokens_per_second

        measured = {AUTOREGRESSIVE: speed(None, first=True)}
        candidates, left_out = {AUTOREGRESSIVE: None}, []
        for label, drafter in self._candidates(model, measured):
            candidates[label] = drafter
            if time_left():
                measured[label] = speed(drafter)
            else:
                left_out.append(label)
        # A second round for the leaders, best of two: noise only ever slows a run down.
        leaders = sorted(measured, key=measured.get, reverse=True)[:self.finalists]
        for label in dict.fromkeys([AUTOREGRESSIVE, *leaders]):  # in order, once each
            if time_left() and len(measured) > 1:
                measured[label] = max(measured[label], speed(candidates[label]))
        best = max(measured, key=measured.get)
        if measured[best] < self.margin * measured[AUTOREGRESSIVE]:
            best = AUTOREGRESSIVE
        return Measurement("drafter", best, "measured", figures=measured, unit="tokens/s",
                           seconds=time.perf_counter() - began, budget=limit,
                           left_out=tuple(left_out), value={"planned_tokens": self.planned_tokens})

    def _key(self, model: MTPModel, batch: int, sampling: SamplingConfig) -> str | None:
        if self.model_id is None:  # a model without a checkpoint: measured every time
            return None
        param = next(model.parameters())
        return tune_key("drafter", model=self.model_id, device=param.device.type,
                        dtype=str(param.dtype).removeprefix("torch."),
                        batch=1 << (batch - 1).bit_length(),
                        sampling="greedy" if sampling.greedy else "sampled",
                        compiled=self.compile, exact=self.exact, width=self.width,
                        spec=fingerprint(repr(self.spec)),
                        saved=fingerprint(sorted(self.context.saved)))
