"""`drafter=auto` / `k=auto`: measure candidate drafters on the first prompts, keep the fastest.

Which drafter pays depends on the model (how well its heads or a draft model agree with it),
the text (prompt lookup pays where it repeats), the batch size, sampling and the machine (the
cost of a verify forward with k tokens relative to one token). So it is measured, not
guessed: each candidate decodes the call's own prompts (or more prompts, in batches of the
call's size: `choose(..., batch_size=)`, which eval uses) for `tokens` new tokens, and the
leaders decode them a second time, their better tokens/s counting. Autoregressive decoding
is always a candidate and any other must beat it by `margin`, so the choice is never slower
than autoregressive decoding by more than the measurement noise.

Candidates: autoregressive, the heads with every k from 2 to n_future, the heads with each
of `trees` (candidate trees, e.g. the `auto:N` trees of a calibrated checkpoint), prompt
lookup, the fastest heads k combined with prompt lookup, and the draft model when one is
given (`k=auto`: autoregressive and the heads only). With `choice_file=PATH` the choice is
cached in that JSON file (the command lines keep one per checkpoint under ~/.cache/mtp),
keyed by what it depends on: model, device, dtype, threads, batch size (in powers of two),
greedy vs sampled decoding, and whether the step is compiled; a second run reads it there.

A budget bounds the measurement (eval's: at most `share`, 10%, of the run's expected
autoregressive decoding time, `planned_tokens` at the rate autoregressive decoding measured
first, and at most `budget` seconds, 30 on a CPU): candidates are measured in order while
time is left, the second round too (a compiled step's warm-up, its compilation, is not
counted); what the budget left out is said (`describe`) and kept
in the cache entry, so a run that plans more tokens measures again.

This module sits above `generate` (it calls it to measure): `choose_drafter` turns a
`DrafterSpec` into a drafter, measuring when the spec asks for it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp.decode.drafters import Combined, DraftModel, Drafter, OwnHeads, PromptLookup
from mtp.decode.drafters.base import check_positive
from mtp.generate.measure import time_generate
from mtp.decode.output import Generation
from mtp.decode.sampling import SamplingConfig
from mtp.decode.spec import AUTOREGRESSIVE, DrafterSpec, heads_drafter
from mtp.decode.tree import Calibration, Tree, resolve_tree
from mtp.model import MTPModel
from mtp.paths import cache_dir
from mtp.tokenizers import Tokenizer

AUTO_TREE_SIZES = (16, 32, 64)  # the calibrated trees `auto` measures against the chain

def default_choice_file(checkpoint: str | Path) -> Path:
    """Where the command lines cache `auto`'s choice for a checkpoint: under $MTP_CACHE
    (default ~/.cache/mtp), one file per checkpoint path, so checkpoints stay read-only."""
    name = hashlib.sha1(str(Path(checkpoint).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "auto" / f"{name}.json"


@dataclass
class Auto:
    """Chooses the fastest drafter by measurement (see the module docstring)."""

    heads_only: bool = False  # k=auto: autoregressive and the heads' k only
    draft_model: DraftModel | None = None
    prompt_lookup: PromptLookup = field(default_factory=PromptLookup)
    choice_file: str | Path | None = None  # a JSON file that caches the choice
    trees: tuple[Tree, ...] = ()  # candidate trees for the heads (within n_future heads)
    compile: bool = False  # measure (and later decode) with the compiled step
    tokens: int = 64  # new tokens per measurement
    margin: float = 1.03  # a drafter must beat autoregressive decoding by this factor
    finalists: int = 3  # candidates measured a second time (with autoregressive decoding)
    budget: float | None = None  # seconds the measurement may take at most (None: no limit)
    planned_tokens: int | None = None  # new tokens the run will decode (bounds the budget)
    share: float = 0.1  # of those tokens' autoregressive time, the most the measurement takes
    measured: dict[str, float] = field(default_factory=dict)  # tokens/s of the last measurement
    skipped: list[str] = field(default_factory=list)  # candidates the budget left unmeasured
    seconds: float = 0.0  # how long the last measurement took
    limit: float | None = None  # the budget the last measurement had, in seconds
    choice: str | None = None  # the label of the last choice

    def __post_init__(self) -> None:
        check_positive("tokens", self.tokens)
        check_positive("finalists", self.finalists)
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin!r}")
        if self.budget is not None and not self.budget > 0:
            raise ValueError(f"budget must be > 0 seconds (or None), got {self.budget!r}")
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1], got {self.share!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, DraftModel):
            raise ValueError(f"draft_model must be a DraftModel, got {self.draft_model!r}")

    def candidates(self, model: MTPModel) -> dict[str, Drafter | None]:
        """Label -> drafter (None: autoregressive), before the combination with lookup."""
        found: dict[str, Drafter | None] = {AUTOREGRESSIVE: None}
        for k in range(2, model.config.n_future + 1):
            found[f"heads(k={k})"] = heads_drafter(model, k)
        for tree in self.trees:
            drafter = heads_drafter(model, model.config.n_future, tree)
            found[repr(drafter)] = drafter
        if not self.heads_only:
            found[repr(self.prompt_lookup)] = self.prompt_lookup
            if self.draft_model is not None:
                found[repr(self.draft_model)] = self.draft_model
        return found

    def choose(self, model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
               sampling: SamplingConfig, max_new_tokens: int,
               batch_size: int | None = None) -> Drafter | None:
        """The fastest drafter for these prompts (None: autoregressive decoding).

        `batch_size`: the batch the drafter will decode (default: all `prompts` at once);
        the prompts are measured in batches of that size, so that a caller can measure on
        more prompts than one batch holds (e.g. eval at batch 1: one prompt is too few).
        """
        candidates = self.candidates(model)
        if self.draft_model is not None:
            self.draft_model.check(model, tokenizer)
        batch_size = len(prompts) if batch_size is None else check_positive(
            "batch_size", batch_size)
        key = self._key(model, batch_size, sampling)
        label = self._read(key)
        self.measured, self.skipped, self.seconds = {}, [], 0.0
        if label is None or (label != AUTOREGRESSIVE and not self._rebuild(label, candidates)):
            batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
            began = time.perf_counter()
            label = self._measure(model, tokenizer, batches, sampling, max_new_tokens,
                                  candidates)
            self.seconds = time.perf_counter() - began
            self._write(key, label)
        self.choice = label
        return self._rebuild(label, candidates) if label != AUTOREGRESSIVE else None

    def _measure(self, model, tokenizer, batches: list[list[str]], sampling, max_new_tokens,
                 candidates: dict[str, Drafter | None]) -> str:
        tokens = min(self.tokens, max_new_tokens)
        began, self.limit = time.perf_counter(), self.budget
        # A compiled candidate's untimed warm-up compiles its step (seconds on a GPU: 8.7 s of
        # a 5.6 s budget on an H100): a cost the run pays once whichever step it keeps, not
        # the candidate's speed, so the budget counts only the timed decoding then.
        compiling = 0.0

        def time_left() -> bool:
            spent = time.perf_counter() - began - compiling
            return self.limit is None or spent < self.limit

        def bound(rate: float) -> None:
            """The budget: at most `share` of the planned tokens' time at autoregressive
            decoding's `rate` (known after its first batch)."""
            if self.planned_tokens is not None:
                share = self.share * self.planned_tokens / rate
                self.limit = share if self.budget is None else min(self.budget, share)

        def speed(drafter: Drafter | None, first: bool = False) -> float:
            called, compiled_before = time.perf_counter(), compiling

            def go_on(seconds: float, done: list[Generation]) -> bool:
                nonlocal compiling
                if self.compile:  # all but the timed `seconds` of this call was its warm-up
                    compiling = compiled_before + time.perf_counter() - called - seconds
                if first:
                    bound(sum(g.stats.new_tokens for g in done) / seconds)
                return time_left()  # one batch at least

            return time_generate(
                model, tokenizer, [p for batch in batches for p in batch],
                max_new_tokens=tokens, batch_size=len(batches[0]), seed=0, warmup_tokens=2,
                go_on=go_on, drafter=drafter, sampling=sampling,
                compile=self.compile).tokens_per_second

        measured = {AUTOREGRESSIVE: speed(candidates[AUTOREGRESSIVE], first=True)}
        for label, drafter in candidates.items():
            if label not in measured:
                if time_left():
                    measured[label] = speed(drafter)
                else:
                    self.skipped.append(label)
        # Prompt lookup combines with a chain of heads only (`Combined` takes no tree).
        heads = [label for label in measured if label.startswith("heads(k=")]
        if heads and not self.heads_only and time_left():
            best = max(heads, key=measured.get)
            label = f"{best}+{self.prompt_lookup!r}"
            candidates[label] = Combined(candidates[best], self.prompt_lookup)
            measured[label] = speed(candidates[label])
        # A second round for the leaders only, best of two: noise only ever slows a run down,
        # and the runner-up gets its chance against the one that got lucky the first time.
        leaders = sorted(measured, key=measured.get, reverse=True)[:self.finalists]
        for label in dict.fromkeys([AUTOREGRESSIVE, *leaders]):  # in order, once each
            if time_left() and len(measured) > 1:
                measured[label] = max(measured[label], speed(candidates[label]))
        self.measured = measured
        best = max(measured, key=measured.get)
        if measured[best] < self.margin * measured[AUTOREGRESSIVE]:
            return AUTOREGRESSIVE
        return best

    def describe(self) -> str:
        """One line: the choice, and what was measured (tokens/s) in how long, or "cached"."""
        if not self.measured:
            return f"auto: {self.choice} (cached: measured before with this checkpoint)"
        rates = ", ".join(f"{label} {rate:.0f}" for label, rate in
                          sorted(self.measured.items(), key=lambda item: -item[1]))
        budget = f" of a {self.limit:.2f} s budget" if self.limit is not None else ""
        left = (f"; {len(self.skipped)} candidates left unmeasured by the budget"
                if self.skipped else "")
        return (f"auto: {self.choice} (measured in {self.seconds:.1f} s{budget}, tokens/s: "
                f"{rates}{left})")

    def _rebuild(self, label: str, candidates: dict[str, Drafter | None]) -> Drafter | None:
        """The drafter a label names, or None if it is not among the candidates."""
        if candidates.get(label) is not None:
            return candidates[label]
        first, _, rest = label.partition("+")
        if rest == repr(self.prompt_lookup) and isinstance(candidates.get(first), OwnHeads):
            return Combined(candidates[first], self.prompt_lookup)
        return None

    def _key(self, model: MTPModel, batch: int, sampling: SamplingConfig) -> str:
        param = next(model.parameters())
        config = json.dumps(model.config.to_dict(), sort_keys=True)
        model_id = hashlib.sha1(config.encode()).hexdigest()[:12]
        bucket = 1 << (batch - 1).bit_length()  # 1, 2, 4, 8, ...
        parts = [model_id, str(param.device), str(param.dtype).removeprefix("torch."),
                 f"threads={torch.get_num_threads()}", f"batch<={bucket}",
                 "greedy" if sampling.greedy else "sampled",
                 "compiled" if self.compile else "eager",
                 "heads" if self.heads_only else "all",
                 repr(self.prompt_lookup), repr(self.draft_model)]
        parts += [f"tree={tree.name}:{len(tree.paths)}" for tree in self.trees]
        return "|".join(parts)

    def _read(self, key: str) -> str | None:
        """The cached choice for `key`; one the budget cut short only for a run that plans
        no more tokens than the one that made it."""
        if self.choice_file is None or not Path(self.choice_file).is_file():
            return None
        try:
            entry = json.loads(Path(self.choice_file).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            return None  # an unreadable cache is remeasured, and rewritten
        if not isinstance(entry, dict):
            return None
        if entry.get("skipped") and (self.planned_tokens or 0) > (entry.get("planned_tokens")
                                                                  or 0):
            return None
        return entry.get("choice")

    def _write(self, key: str, label: str) -> None:
        if self.choice_file is None:
            return
        path = Path(self.choice_file)
        try:
            table = json.loads(path.read_text()) if path.is_file() else {}
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[key] = {"choice": label, "tokens_per_second": {
            name: round(rate, 1) for name, rate in self.measured.items()},
            "skipped": self.skipped, "planned_tokens": self.planned_tokens,
            "seconds": round(self.seconds, 1)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")


def auto_trees(model: MTPModel, calibration: Calibration | None) -> tuple[Tree, ...]:
    """`auto`'s candidate trees: a calibrated checkpoint's auto:N for N in AUTO_TREE_SIZES."""
    if calibration is None or model.config.n_future < 2:
        return ()
    return tuple(resolve_tree(f"auto:{size}", k=model.config.n_future,
                              vocab_size=model.config.vocab_size, calibration=calibration)
                 for size in AUTO_TREE_SIZES)


def make_auto(model: MTPModel, spec: DrafterSpec, *, calibration: Calibration | None = None,
              cache_file: str | Path | None = None, compile: bool = False,
              budget: float | None = None, planned_tokens: int | None = None) -> Auto:
    """The `Auto` a measured spec asks for: drafter=auto (every candidate, sized by the spec's
    options) or k=auto (autoregressive and the heads' k), within `budget` seconds and a share
    of `planned_tokens`' time (see the module docstring)."""
    draft_model = spec.load_draft_model(model) if spec.draft_model is not None else None
    # With a draft model, num_draft sizes it; prompt lookup keeps its default.
    lookup = DrafterSpec(drafter="prompt_lookup", max_ngram=spec.max_ngram,
                         min_ngram=spec.min_ngram,
                         num_draft=None if draft_model is not None else spec.num_draft)
    return Auto(heads_only=spec.k == "auto", draft_model=draft_model,
                prompt_lookup=lookup.prompt_lookup(), choice_file=cache_file,
                trees=auto_trees(model, calibration), compile=compile, budget=budget,
                planned_tokens=planned_tokens)


def choose_drafter(model: MTPModel, tokenizer: Tokenizer, spec: DrafterSpec, prompts: list[str],
                   *, sampling: SamplingConfig, max_new_tokens: int,
                   batch_size: int | None = None, calibration: Calibration | None = None,
                   cache_file: str | Path | None = None, compile: bool = False,
                   budget: float | None = None,
                   planned_tokens: int | None = None) -> tuple[Drafter | None, Auto | None]:
    """The drafter `spec` names, measured on `prompts` when it asks for that (drafter=auto,
    k=auto); also the `Auto` that measured (None when nothing was measured).

    `calibration` (a checkpoint's tree.json) resolves tree=auto:N and gives auto its trees;
    `cache_file` keeps auto's choice between runs; `budget` (seconds) and `planned_tokens`
    bound the measurement (`Auto`).
    """
    if not spec.measured:
        return spec.build(model, calibration), None
    auto = make_auto(model, spec, calibration=calibration, cache_file=cache_file,
                     compile=compile, budget=budget, planned_tokens=planned_tokens)
    return auto.choose(model, tokenizer, prompts, sampling=sampling,
                       max_new_tokens=max_new_tokens, batch_size=batch_size), auto
