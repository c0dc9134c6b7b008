"""Opening a checkpoint for decoding: the one function every command uses (the generate
command line, eval, the benchmark scripts), with every choice measured on the model that
will decode.

    settings = DecodeSettings(drafter="auto", dtype="auto")
    decoder = open_decoder("runs/x/export", settings, prompts=["def f(x):"])
    [result] = decoder.generate(["def f(x):"], max_new_tokens=64)

`open_decoder` makes its choices in this order, each a `mtp.tune.Measurement` reported and
cached: load the checkpoint (float32 when the dtype is measured) and the choices saved for
it; the drafter (drafter=auto, k=auto: each candidate decoding as it would, in its dtype
with its threads); the dtype (dtype=auto on a CPU: float32 or bfloat16, whichever runs a
forward of the drafter's step width faster); the threads (a few decode steps); exact mode
(exact=auto: on where its steps decode within 5% of the plain steps' speed, `choose_exact`);
compile (as asked, else on a GPU).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mtp.checkpoint import load
from mtp.cli import AUTO, check_flag, dtype_name, parse_dtype
from mtp.decode.acceptance import acceptance_rule
from mtp.decode.drafters.base import Drafter, DrafterContext
from mtp.decode.drafters.registry import DrafterSpec, drafter_types
from mtp.decode.loop import check_exact, generate
from mtp.decode.output import Generation, TextCallback
from mtp.decode.sampling import SamplingConfig
from mtp.generate.auto import Auto
from mtp.generate.measure import plain_forward_seconds, step_width, time_generate
from mtp.model import MTPModel, decodes_on_kernels, use_kernels
from mtp.tokenizers import Tokenizer
from mtp.tune import (Measurement, TuneCache, check_threads, choose_threads, cpu_has_bf16,
                      fingerprint, machine, report, tune, tune_key)

AUTO_SECONDS = 30.0  # the most `drafter=auto` measures, unless the caller says otherwise
AUTO_PROMPTS = 4  # and on at least this many prompts, when the caller has them
EXACT_COST = 1.05  # exact=auto keeps exact mode where it decodes at least 1/1.05 as fast
EXACT_TOKENS = 24  # tokens each of exact=auto's timed calls decodes
Report = Callable[[Measurement], None]


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
        if not self.budget > 0:
            raise ValueError(f"budget={self.budget!r} must be > 0 seconds")

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


@dataclass
class Decoder:
    """A model opened for decoding with its choices made (`open_decoder`)."""

    model: MTPModel
    tokenizer: Tokenizer
    drafter: Drafter | None
    settings: DecodeSettings
    records: list[Measurement] = field(default_factory=list)
    measured_drafter: bool = False

    @property
    def label(self) -> str:
        """The drafter, as printed: its name, or "auto -> <choice>" when it was measured."""
        name = repr(self.drafter) if self.drafter is not None else "autoregressive"
        return f"auto -> {name}" if self.measured_drafter else name

    def generate(self, prompts: list[str], *, max_new_tokens: int = 256,
                 stop: Sequence[str] | str = (), seed: int | None = None,
                 on_text: TextCallback | None = None) -> list[Generation]:
        """`mtp.decode.generate` with this decoder's drafter and settings (`seed` overrides
        the settings' seed for this call)."""
        settings = self.settings
        return generate(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                        **settings.generate_options(self.drafter), stop=stop,
                        seed=settings.seed if seed is None else seed, on_text=on_text)


def open_decoder(checkpoint: str | Path | None, settings: DecodeSettings, *,
                 loaded: tuple[MTPModel, Tokenizer] | None = None, prompts: Sequence[str] = (),
                 batch_size: int = 1, max_new_tokens: int = 64,
                 planned_tokens: int | None = None, report: Report | None = report,
                 cache: TuneCache | None = None) -> Decoder:
    """`checkpoint` opened for decoding with `settings` (module docstring).

    `loaded`: the model and tokenizer, loaded in `settings.load_dtype` (then `checkpoint` may
    be None: no saved choices, nothing cached). `prompts`, `batch_size`, `max_new_tokens`:
    what measured choices are measured on; `planned_tokens`: the tokens the run will decode,
    of which `drafter=auto` spends at most a tenth of the time measuring.
    """
    report = report or (lambda record: None)
    if loaded is None:
        if checkpoint is None:
            raise ValueError("open_decoder needs a checkpoint, or the model loaded=(model, "
                             "tokenizer)")
        loaded = load(checkpoint, device=settings.device, dtype=settings.load_dtype)
    model, tokenizer = loaded
    kernels = kernels_record(model, settings)  # before any measurement: they decode on them
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
    model_id = checkpoint_id(checkpoint) if checkpoint is not None else None
    context = DrafterContext(saved=saved_choices(checkpoint, model_id, cache))
    variants = DtypeVariants(model, measure=settings.dtype == AUTO, cache=cache)
    prompts = list(prompts) or ["def main():\n"]
    spec = settings.spec
    measured = spec.measured

    def prepare(drafter: Drafter | None) -> MTPModel:
        """The model in the dtype and with the threads a step of this drafter wants."""
        chosen = variants.model(variants.choose(settings.step_width(drafter),
                                                batch_size).value)
        choose_decode_threads(chosen, tokenizer, prompts[0], settings, drafter=drafter,
                              batch=batch_size, cache=cache)
        return chosen

    records = [kernels]
    report(kernels)
    if measured:
        auto = Auto(spec=spec, context=context, compile=settings.compiled,
                    exact=settings.exact is True,
                    width=settings.width if settings.exact is True else None,
                    budget=settings.budget, planned_tokens=planned_tokens,
                    model_id=model_id and f"{model_id}|dtype={settings.dtype}", cache=cache)
        drafter = auto.choose(model, tokenizer, prompts[:max(AUTO_PROMPTS, batch_size)],
                              sampling=settings.sampling, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, prepare=prepare)
        records.append(auto.record)
        report(auto.record)
    else:
        drafter = spec.build(model, context)
    dtype = variants.choose(settings.step_width(drafter), batch_size)
    model = variants.keep(dtype.value)
    threads = choose_decode_threads(model, tokenizer, prompts[0], settings, drafter=drafter,
                                    batch=batch_size, cache=cache)
    exact = choose_exact(model, tokenizer, prompts[:batch_size], settings, drafter,
                         model_id=model_id, cache=cache)
    for record in (dtype, threads, exact):
        records.append(record)
        report(record)
    settings = replace(settings, exact=exact.value)
    return Decoder(model, tokenizer, drafter, settings, records, measured_drafter=measured)


def choose_exact(model: MTPModel, tokenizer: Tokenizer, prompts: Sequence[str],
                 settings: DecodeSettings, drafter: Drafter | None, *,
                 model_id: str | None = None, cache: TuneCache | None = None) -> Measurement:
    """Exact mode or not: as set; for exact=auto, on where a short greedy call decodes at
    least 1/EXACT_COST as fast in exact mode as with the plain step (timed in turns, the best
    of two each), off where the acceptance rule is not SpecInfer's."""
    if settings.exact != AUTO:
        return Measurement("exact", "on" if settings.exact else "off", "set",
                           value=settings.exact)
    if not acceptance_rule(settings.acceptance).exact_mode:
        return Measurement("exact", "off", "fixed", f"acceptance={settings.acceptance} is a "
                           f"rule of its own", value=False)
    if decodes_on_kernels(model):  # the plain step is the exact step: nothing to measure
        return Measurement("exact", "on", "fixed", "on the kernels every step is exact, at "
                           "no cost", value=True)
    options = {"drafter": drafter, "compile": settings.compiled, "seed": 0}
    width = settings.width

    def measure() -> Measurement:
        rates: dict[str, list[float]] = {"plain": [], "exact": []}
        for round_ in range(2):
            for mode in rates:
                exact = {"exact": True, "width": width} if mode == "exact" else {}
                rates[mode].append(time_generate(
                    model, tokenizer, prompts, max_new_tokens=EXACT_TOKENS,
                    batch_size=len(prompts), warmup_tokens=4 if round_ == 0 else 0,
                    **options, **exact).tokens_per_second)
        figures = {mode: max(values) for mode, values in rates.items()}
        on = figures["exact"] * EXACT_COST >= figures["plain"]
        why = (f"exact mode within {EXACT_COST - 1:.0%} of the plain step's speed" if on else
               f"exact mode more than {EXACT_COST - 1:.0%} slower than the plain step")
        return Measurement("exact", "on" if on else "off", "measured", why, figures=figures,
                           unit="tokens/s", machine=machine(), value=on)

    param = next(model.parameters())
    key = tune_key("exact", model=model_id or fingerprint(model.config.to_dict()),
                   drafter=repr(drafter), width=width, batch=len(prompts),
                   dtype=dtype_name(param.dtype), threads=torch.get_num_threads(),
                   compile=settings.compiled)
    return tune("exact", key, measure, cache=cache)


def kernels_record(model: MTPModel, settings: DecodeSettings) -> Measurement:
    """Mark `model` to decode through `mtp.kernels` or torch, as `settings.kernels` asks and
    where they run (`model.use_kernels`); the record says which."""
    line = use_kernels(model, settings.kernels)
    on = decodes_on_kernels(model)
    return Measurement("kernels", "on" if on else "off", "set" if not settings.kernels else
                       "fixed", line, value=on)


def checkpoint_id(path: str | Path) -> str:
    """A checkpoint's identity for the tuner's cache: its resolved path and its files' sizes
    and modification times (not the choices saved beside it)."""
    path = Path(path).resolve()
    saved = {cls.saved_file for cls in drafter_types().values() if cls.saved_file}
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name not in saved) \
        if path.is_dir() else [path]
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return hashlib.sha1(json.dumps([str(path), stats]).encode()).hexdigest()[:16]


def saved_key(step: str, model_id: str) -> str:
    """The tuner's key of a tuning step's choice for a checkpoint (machine-independent)."""
    return tune_key(step, timed=False, model=model_id)


def saved_file(checkpoint: str | Path, name: str) -> Path:
    """A saved choice's file beside a checkpoint: in its directory, or beside a single file
    (a .ckpt, a GGUF) as FILE.<name>."""
    checkpoint = Path(checkpoint)
    return checkpoint / name if checkpoint.is_dir() else checkpoint.with_name(
        f"{checkpoint.name}.{name}")


def save_choice(checkpoint: str | Path, record: Measurement, name: str,
                output: str | Path | None = None, cache: TuneCache | None = None) -> list[str]:
    """Keep a tuning step's choice (`record.value`) for `checkpoint` with the tuner, and as
    the file `name` in `output` (a directory) or at `output` when given; where it went."""
    cache = cache or TuneCache()
    cache.put(saved_key(record.step, checkpoint_id(checkpoint)), record)
    where = [f"{record.describe()}, in {cache.path}"]
    if output is not None:
        path = Path(output) / name if Path(output).is_dir() else Path(output)
        path.write_text(json.dumps(record.value, indent=1) + "\n")
        where.append(str(path))
    return where


def saved_choices(checkpoint: Path | None, model_id: str | None,
                  cache: TuneCache | None = None) -> dict[str, Any]:
    """The saved choice of every tuning step a drafter reads, by step: the tuner's record
    for this checkpoint, else the file beside it."""
    found: dict[str, Any] = {}
    cache = cache or TuneCache()
    for cls in drafter_types().values():
        if cls.saved is None or checkpoint is None:
            continue
        record = cache.get(saved_key(cls.saved, model_id)) if model_id else None
        if record is not None:
            found[cls.saved] = record.value
            continue
        path = saved_file(checkpoint, cls.saved_file)
        if path.is_file():
            try:
                found[cls.saved] = json.loads(path.read_text())
            except ValueError as error:
                raise ValueError(f"{path} is not JSON: {error}") from None
    return found


class DtypeVariants:
    """A float32 model and, on demand, its bfloat16 copy; the dtype choice per step width."""

    def __init__(self, model: MTPModel, *, measure: bool, cache: TuneCache | None) -> None:
        self.base, self.measure, self.cache = model, measure, cache
        self.models = {dtype_name(next(model.parameters()).dtype): model}

    def model(self, dtype: str) -> MTPModel:
        if dtype not in self.models:
            self.models[dtype] = copy.deepcopy(self.base).to(parse_dtype(dtype))
        return self.models[dtype]

    def keep(self, dtype: str) -> MTPModel:
        """The model in `dtype`, the others released."""
        model = self.model(dtype)
        self.models = {dtype: model}
        return model

    def choose(self, width: int, batch: int) -> Measurement:
        """float32 or bfloat16 for `width` tokens a step on a CPU, whichever runs a forward
        faster; as loaded on a CPU without bf16 arithmetic, on a GPU, in another dtype, or
        when the dtype was named."""
        param = next(self.base.parameters())
        loaded = dtype_name(param.dtype)
        why = ("as loaded" if not self.measure else
               "as loaded: not a float32 model on a CPU"
               if param.device.type != "cpu" or param.dtype != torch.float32 else
               "this CPU has no bf16 arithmetic" if not cpu_has_bf16() else None)
        if why is not None:
            return Measurement("dtype", loaded, "fixed", why, value=loaded)

        def measure() -> Measurement:
            seconds = {name: plain_forward_seconds(self.model(name), width, batch) * 1e3
                       for name in ("float32", "bfloat16")}
            best = min(seconds, key=seconds.get)
            return Measurement("dtype", best, "measured", f"a forward of {width} tokens",
                               figures=seconds, unit="ms", lower_is_better=True,
                               machine=machine(), value=best)

        key = tune_key("dtype", model=fingerprint(self.base.config.to_dict()), width=width,
                       batch=batch)
        return tune("dtype", key, measure, cache=self.cache)


def choose_decode_threads(model: MTPModel, tokenizer: Tokenizer, prompt: str,
                          settings: DecodeSettings | None = None, *,
                          drafter: Drafter | None = None, batch: int = 1, budget: float = 1.0,
                          cache: TuneCache | None = None) -> Measurement:
    """The thread count for decoding with `model` and `drafter`, measured on a short
    `generate` call (8 new tokens after the prompt's first 64 characters, `batch` rows)."""
    settings = settings or DecodeSettings()
    requested = check_threads(settings.threads)
    param = next(model.parameters())
    if param.device.type != "cpu" and requested is None:  # a GPU's step uses no CPU threads
        return Measurement("threads", str(torch.get_num_threads()), "fixed",
                           f"not measured on {param.device.type}",
                           value=torch.get_num_threads())
    key = tune_key("threads", kind="decode", model=fingerprint(model.config.to_dict()),
                   width=settings.step_width(drafter), batch=batch,
                   dtype=dtype_name(param.dtype), device=param.device.type)
    prompts = [prompt[:64]] * batch
    options = settings.generate_options(drafter) | {"compile": False}  # the step, not a graph

    def step() -> None:
        generate(model, tokenizer, prompts, max_new_tokens=8, **options)

    return choose_threads(step, key, requested=requested, unit="calls/s", cache=cache)
