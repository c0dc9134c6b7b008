"""Opening a checkpoint for decoding: the one function every command uses (generate, eval,
the benchmark scripts), with every choice measured on the model that will decode.

    settings = DecodeSettings(drafter="auto", dtype="auto")
    decoder = open_decoder("runs/x/export", settings, prompts=["def f(x):"])
    [result] = decoder.generate(["def f(x):"], max_new_tokens=64)

`open_decoder` chooses, in order, each choice a `mtp.tune.Measurement` reported and cached:
the checkpoint (float32 when the dtype is measured) and its saved choices (`saved.py`); the
drafter (`auto.py`: each candidate decoding as it would, in its dtype with its threads); the
dtype, the threads and exact mode (`choices.py`); compile (as asked, else on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from mtp.checkpoint import load
from mtp.cli import AUTO
from mtp.decode.drafters.base import Drafter, DrafterContext
from mtp.decode.loop import generate
from mtp.decode.output import Generation, TextCallback
from mtp.generate.auto import Auto
from mtp.generate.choices import (DtypeVariants, choose_decode_threads, choose_exact,
                                  kernels_record)
from mtp.generate.saved import checkpoint_id, saved_choices
from mtp.generate.settings import DecodeSettings
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer
from mtp.tune import Measurement, TuneCache, report

AUTO_PROMPTS = 4  # `drafter=auto` measures on at least this many prompts, when the caller has them
Report = Callable[[Measurement], None]


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
        return generate(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                        **self.settings.generate_options(self.drafter), stop=stop,
                        seed=self.settings.seed if seed is None else seed, on_text=on_text)


def open_decoder(checkpoint: str | Path | None, settings: DecodeSettings, *,
                 loaded: tuple[MTPModel, Tokenizer] | None = None, prompts: Sequence[str] = (),
                 batch_size: int = 1, max_new_tokens: int = 64,
                 planned_tokens: int | None = None, report: Report | None = report,
                 cache: TuneCache | None = None) -> Decoder:
    """`checkpoint` opened for decoding with `settings` (module docstring). `loaded`: the
    model and tokenizer in `settings.load_dtype` (then `checkpoint` may be None: no saved
    choices, nothing cached); `planned_tokens`: the run's tokens, of which `drafter=auto`
    spends at most a tenth of the time measuring."""
    report = report or (lambda record: None)
    if loaded is None:
        if checkpoint is None:
            raise ValueError("open_decoder needs a checkpoint, or the model loaded=(model, "
                             "tokenizer)")
        loaded = load(checkpoint, device=settings.device, dtype=settings.load_dtype)
    model, tokenizer = loaded
    records: list[Measurement] = []

    def made(record: Measurement) -> Measurement:  # each choice reported as it is made
        records.append(record)
        report(record)
        return record

    made(kernels_record(model, settings))  # before any measurement: they decode on them
    model_id = checkpoint_id(checkpoint) if checkpoint is not None else None
    context = DrafterContext(saved=saved_choices(checkpoint, model_id, cache))
    variants = DtypeVariants(model, measure=settings.dtype == AUTO, cache=cache)
    prompts = list(prompts) or ["def main():\n"]
    spec, measured = settings.spec, settings.spec.measured

    def prepare(drafter: Drafter | None, made: Report = lambda record: None) -> MTPModel:
        """The model in the dtype and with the threads a step of this drafter wants; `made`
        reports the choices (the final drafter's)."""
        record = variants.choose(settings.step_width(drafter), batch_size)
        made(record)
        chosen = variants.model(record.value)
        made(choose_decode_threads(chosen, tokenizer, prompts[0], settings, drafter=drafter,
                                   batch=batch_size, cache=cache))
        return chosen

    if measured:
        auto = Auto(spec=spec, context=context, compile=settings.compiled,
                    exact=settings.exact is True,
                    width=settings.width if settings.exact is True else None,
                    budget=settings.budget, planned_tokens=planned_tokens,
                    model_id=model_id and f"{model_id}|dtype={settings.dtype}", cache=cache)
        drafter = auto.choose(model, tokenizer, prompts[:max(AUTO_PROMPTS, batch_size)],
                              sampling=settings.sampling, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, prepare=prepare)
        made(auto.record)
    else:
        drafter = spec.build(model, context)
    model = prepare(drafter, made)
    exact = made(choose_exact(model, tokenizer, prompts[:batch_size], settings, drafter,
                              model_id=model_id, cache=cache))
    settings = replace(settings, exact=exact.value)
    return Decoder(model, tokenizer, drafter, settings, records, measured_drafter=measured)
