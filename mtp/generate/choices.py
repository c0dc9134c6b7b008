"""The choices `open_decoder` measures on the model that will decode, besides the drafter
(`auto.py`): the kernels, the dtype (`DtypeVariants`), the threads and exact mode; each one
`mtp.tune.Measurement`, cached by `mtp.tune.tune`."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch

from mtp.cli import AUTO, dtype_name, parse_dtype
from mtp.decode.acceptance import acceptance_rule
from mtp.decode.drafters.base import Drafter
from mtp.decode.loop import generate
from mtp.generate.measure import plain_forward_seconds, time_generate
from mtp.generate.settings import DecodeSettings
from mtp.model import MTPModel, decodes_on_kernels, use_kernels
from mtp.tokenizers import Tokenizer
from mtp.tune import (Measurement, TuneCache, check_threads, choose_threads, cpu_has_bf16,
                      fingerprint, tune, tune_key)

EXACT_COST = 1.05  # exact=auto keeps exact mode where it decodes at least 1/1.05 as fast
EXACT_TOKENS = 24  # tokens each of exact=auto's timed calls decodes


def kernels_record(model: MTPModel, settings: DecodeSettings) -> Measurement:
    """Mark `model` to decode through `mtp.kernels` or torch, as `settings.kernels` asks and
    where they run (`model.use_kernels`); the record says which."""
    line, on = use_kernels(model, settings.kernels), decodes_on_kernels(model)
    return Measurement("kernels", "on" if on else "off", "set" if not settings.kernels else
                       "fixed", line, value=on)


class DtypeVariants:
    """A float32 model and, on demand, its bfloat16 copy; the dtype choice per step width."""

    def __init__(self, model: MTPModel, *, measure: bool, cache: TuneCache | None) -> None:
        self.base, self.measure, self.cache = model, measure, cache
        self.models = {dtype_name(next(model.parameters()).dtype): model}

    def model(self, dtype: str) -> MTPModel:
        if dtype not in self.models:
            self.models[dtype] = copy.deepcopy(self.base).to(parse_dtype(dtype))
        return self.models[dtype]

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
                               figures=seconds, unit="ms", lower_is_better=True, value=best)

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
    options = settings.generate_options(drafter) | {"compile": False}  # the step, not a graph
    step = functools.partial(generate, model, tokenizer, [prompt[:64]] * batch, max_new_tokens=8,
                             **options)
    return choose_threads(step, key, requested=requested, budget=budget, unit="calls/s",
                          cache=cache)


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
    modes = {"plain": {}, "exact": {"exact": True, "width": settings.width}}

    def measure() -> Measurement:
        figures = dict.fromkeys(modes, 0.0)
        for round_ in range(2):
            for mode, exact in modes.items():
                timed = time_generate(model, tokenizer, prompts, max_new_tokens=EXACT_TOKENS,
                                      batch_size=len(prompts), seed=0, drafter=drafter,
                                      warmup_tokens=4 if round_ == 0 else 0,
                                      compile=settings.compiled, **exact)
                figures[mode] = max(figures[mode], timed.tokens_per_second)
        on = figures["exact"] * EXACT_COST >= figures["plain"]
        why = (f"exact mode within {EXACT_COST - 1:.0%} of the plain step's speed" if on else
               f"exact mode more than {EXACT_COST - 1:.0%} slower than the plain step")
        return Measurement("exact", "on" if on else "off", "measured", why, figures=figures,
                           unit="tokens/s", value=on)

    param = next(model.parameters())
    key = tune_key("exact", model=model_id or fingerprint(model.config.to_dict()),
                   drafter=repr(drafter), width=settings.width, batch=len(prompts),
                   dtype=dtype_name(param.dtype), threads=torch.get_num_threads(),
                   compile=settings.compiled)
    return tune("exact", key, measure, cache=cache)
