"""A training run's settings: typed, frozen objects built once from the composed config by
`check_settings(cfg)`, before any data or model work. Each checks its own fields,
`TrainSettings` those across objects, `check_model` those that need the architecture; an error
is one line naming the key as typed (`optim.lr=-1.0 must be > 0`). Checkpoints store them as
plain dicts (`to_dict`), read with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtp.cli import check_choice, check_flag, check_number, check_numbers, check_positive
from mtp.train.finetune import NEW_HEADS
from mtp.train.flops import check_peak_flops
from mtp.train.parallel import check_options
from mtp.train.schedule import SCHEDULES, Progress, distance_factors
from mtp.tune import check_threads

LOSS_MODES: tuple[str, ...] = ("naive", "headwise", "chunked")
START = Progress()  # a run's first step


def _unit(value: float) -> bool:
    return 0 <= value <= 1


def _shown(values: object) -> object:
    """A list as the user typed it (a tuple shows as a list)."""
    return list(values) if isinstance(values, tuple) else values


def _set(settings: object, name: str, value: object) -> None:
    """Store a frozen field's normalised value (a tuple for a list, a float for an int)."""
    object.__setattr__(settings, name, value)


def _number(settings: object, key: str, check: Callable[..., Any], *args: Any, **kw: Any) -> None:
    """Store `check(key, value, ...)` (`check_number(s)`) of the field `key` ends in."""
    name = key.rsplit(".", 1)[-1]
    _set(settings, name, check(key, getattr(settings, name), *args, **kw))


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """`loss.*` of conf/config.yaml (`mtp.train.loss`); the weights are read at a `Progress`,
    and a training step takes `resolved(...)`, the step's weights fixed."""

    mode: str = "headwise"
    weights: tuple[float, ...] | None = None
    schedule: str = "constant"
    schedule_steps: tuple[int, ...] | None = None
    schedule_factor: float | None = None
    ahead: tuple[float, ...] | None = None
    early_exit: int | None = None
    early_exit_weight: float = 1.0
    chunk_size: int = 4096

    def __post_init__(self) -> None:
        check_choice("loss.mode", self.mode, LOSS_MODES)
        for name, what in (("weights", "one per head (or null: all 1)"),
                           ("ahead", "one per token beyond t + 1 (or null: none)")):
            if getattr(self, name) is not None:
                _number(self, f"loss.{name}", check_numbers, _unit,
                        f"a list of numbers in [0, 1], {what}")
        check_choice("loss.schedule", self.schedule, SCHEDULES)
        self._check_schedule()
        if self.early_exit is not None:
            check_positive("loss.early_exit", self.early_exit, 1, "a trunk layer from 1 to "
                           "n_layers - 1 (the exit reads the stream after layer early_exit - 1)")
        _number(self, "loss.early_exit_weight", check_number, lambda v: v >= 0, ">= 0")
        check_positive("loss.chunk_size", self.chunk_size, 1, ">= 1")

    def _check_schedule(self) -> None:  # unused points and factor are not checked
        if self.schedule_steps is not None:
            steps = check_numbers("loss.schedule_steps", self.schedule_steps,
                                  lambda v: v >= 0 and v.is_integer(),
                                  "a list of optimizer steps >= 0 (or null)")
            _set(self, "schedule_steps", tuple(map(int, steps)))
        steps, schedule = self.schedule_steps, self.schedule
        if schedule == "stepped":
            if steps is None or len(steps) != 1 or self.schedule_factor is None:
                raise ValueError(f"loss.schedule=stepped needs loss.schedule_steps=[STEP] (the "
                                 f"switch) and loss.schedule_factor (in [0, 1]), got "
                                 f"{_shown(steps)} and {self.schedule_factor!r}")
            _number(self, "loss.schedule_factor", check_number, _unit, "in [0, 1]")
        elif schedule in ("anneal", "ramp") and steps is not None and (
                len(steps) != 2 or not steps[0] < steps[1]):
            raise ValueError(f"loss.schedule={schedule} takes loss.schedule_steps=[START, END] "
                             f"with START < END (or null: the whole run), got {_shown(steps)}")

    def levels(self, n_future: int) -> int:
        """Distances beyond the next token that the loss scores: heads 1..n-1, look-ahead."""
        return max(n_future - 1, len(self.ahead or ()))

    def lookahead(self, n_future: int) -> int:
        """Tokens after each input that the loss reads (the data's blocks carry them)."""
        return 1 + self.levels(n_future)

    def _factors(self, n_future: int, at: Progress) -> tuple[float, ...]:
        steps = self.schedule_steps or ()
        start = at.of(steps[0]) if steps else 0.0
        end = at.of(steps[1]) if len(steps) > 1 else 1.0
        return distance_factors(self.schedule, self.levels(n_future), at.fraction,
                                window=(start, end), factor=self.schedule_factor or 0.0)

    def head_weights(self, n_future: int, at: Progress = START) -> tuple[float, ...]:
        """Each head's loss weight at `at`: its base weight times its distance's factor."""
        if self.weights is None:
            base = (1.0,) * n_future
        elif len(self.weights) != n_future:
            raise ValueError(f"loss.weights={list(self.weights)} needs one weight per head "
                             f"(model.n_future={n_future})")
        else:
            base = self.weights
        if self.schedule == "constant":
            return base
        factors = self._factors(n_future, at)
        return (base[0], *(w * f for w, f in zip(base[1:], factors)))

    def ahead_weights(self, n_future: int, at: Progress = START) -> tuple[float, ...]:
        """The weights of head 0's look-ahead terms (tokens t + 2, ...) at `at`."""
        if not self.ahead or self.schedule == "constant":
            return self.ahead or ()
        return tuple(w * f for w, f in zip(self.ahead, self._factors(n_future, at)))

    def resolved(self, n_future: int, at: Progress = START, scale: float = 1.0
                 ) -> LossSettings:
        """These settings with the weights of `at` fixed, each times `scale` (1 / accumulate:
        a micro-batch's share of a step's gradient)."""
        if self.schedule == "constant" and scale == 1.0:
            return self
        return dataclasses.replace(
            self, weights=tuple(w * scale for w in self.head_weights(n_future, at)),
            ahead=tuple(w * scale for w in self.ahead_weights(n_future, at)) or None,
            schedule="constant", schedule_steps=None, schedule_factor=None,
            early_exit_weight=self.early_exit_weight * scale)

    def check_model(self, *, n_future: int, n_layers: int | None = None) -> None:
        """A ValueError naming the setting unless these fit the model (n_layers None: unknown)."""
        self.head_weights(n_future)
        if self.early_exit is not None and n_layers is not None \
                and self.early_exit >= n_layers:
            raise ValueError(f"loss.early_exit={self.early_exit} must be a trunk layer from 1 "
                             f"to n_layers - 1 = {n_layers - 1} (the exit reads the stream "
                             f"after layer early_exit - 1)")


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """`optim.*` of conf/config.yaml: AdamW, its schedule (`mtp.train.optim`), accumulation
    and what trains (Medusa-1's frozen trunk, Medusa-2's lower rate and warm-up)."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    accumulate: int = 1
    freeze_trunk: bool = False
    cache_trunk: bool = False
    trunk_lr_mult: float | None = None
    heads_only_steps: int = 0

    def __post_init__(self) -> None:
        _number(self, "optim.lr", check_number, lambda v: v > 0, "> 0")
        for key in ("optim.weight_decay", "optim.grad_clip"):
            _number(self, key, check_number, lambda v: v >= 0, ">= 0")
        _number(self, "optim.betas", check_numbers, lambda v: 0 <= v < 1,
                "two numbers in [0, 1)", length=2)
        _number(self, "optim.eps", check_number, lambda v: v > 0, "> 0")
        check_positive("optim.warmup_steps", self.warmup_steps, 0)
        _number(self, "optim.min_lr_ratio", check_number, _unit, "in [0, 1]")
        check_positive("optim.accumulate", self.accumulate)
        check_flag("optim.freeze_trunk", self.freeze_trunk)
        check_flag("optim.cache_trunk", self.cache_trunk)
        if self.trunk_lr_mult is not None:
            _number(self, "optim.trunk_lr_mult", check_number, lambda v: v >= 0,
                    ">= 0 (or null: 1)")
        check_positive("optim.heads_only_steps", self.heads_only_steps, 0)
        if self.freeze_trunk and (self.trunk_lr_mult is not None or self.heads_only_steps):
            raise ValueError(f"optim.freeze_trunk=true with optim.trunk_lr_mult="
                             f"{self.trunk_lr_mult} and optim.heads_only_steps="
                             f"{self.heads_only_steps}: a frozen trunk has no optimizer group "
                             f"that could train it (Medusa-2 is freeze_trunk=false)")
        if self.cache_trunk and not self.freeze_trunk:
            raise ValueError("optim.cache_trunk=true keeps a frozen trunk's outputs: it needs "
                             "optim.freeze_trunk=true (Medusa-1)")

    @property
    def base_lr_mult(self) -> float:
        """The base model's learning rate over the heads' (`trunk_lr_mult`, 1 when unset)."""
        return 1.0 if self.trunk_lr_mult is None else self.trunk_lr_mult


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The run's shape and machinery: `seq_len`, `trainer.max_steps` (the schedule's span),
    `threads`, `compile`, `activation_checkpointing`, `fsdp.*`, `trainer.peak_flops`."""

    seq_len: int
    max_steps: int
    threads: int | None = None
    compile: bool = False
    activation_checkpointing: str = "none"
    param_dtype: str = "auto"
    reduce_dtype: str = "float32"
    peak_flops: float | str | None = None

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_positive("trainer.max_steps", self.max_steps, 1,
                       "a positive step budget: the learning-rate schedule is laid out over it")
        _set(self, "threads", check_threads(self.threads))
        check_flag("compile", self.compile)
        check_options(activation_checkpointing=self.activation_checkpointing,
                      param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        check_peak_flops(self.peak_flops)


@dataclass(frozen=True, kw_only=True)
class InitSettings:
    """Where the weights start (`init_from`, `init.*`; `mtp.train.finetune`): a checkpoint
    (None: random), how heads it lacks start (`new_heads`), whether to drop heads."""

    init_from: str | None = None
    new_heads: str | None = None
    drop_heads: bool = False

    def __post_init__(self) -> None:
        if self.new_heads is not None:
            check_choice("init.new_heads", self.new_heads, NEW_HEADS, "or null: add no heads")
        check_flag("init.drop_heads", self.drop_heads)


@dataclass(frozen=True, kw_only=True)
class DecodeCheckSettings:
    """`decode.*`: greedy decoding measured on the export after training
    (`mtp.train.summary`; checked against the model by `summary.decode_prompts`)."""

    enabled: bool = True
    prompts: int = 4
    max_new_tokens: int = 64
    batch_size: int = 1
    trees: tuple[str, ...] = ("tree16",)

    def __post_init__(self) -> None:
        check_flag("decode.enabled", self.enabled)
        for key in ("prompts", "max_new_tokens", "batch_size"):
            check_positive(f"decode.{key}", getattr(self, key))
        if isinstance(self.trees, str) or not all(isinstance(t, str) for t in self.trees):
            raise ValueError(f"decode.trees={self.trees!r} must be a list of tree names")
        _set(self, "trees", tuple(self.trees))


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """Every setting of a training run, checked together."""

    run: RunSettings
    loss: LossSettings = field(default_factory=LossSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    init: InitSettings = field(default_factory=InitSettings)
    decode: DecodeCheckSettings = field(default_factory=DecodeCheckSettings)

    def __post_init__(self) -> None:
        optim = self.optim
        if optim.freeze_trunk and not self.init.init_from:
            raise ValueError("optim.freeze_trunk=true needs init_from=<checkpoint>: freezing a "
                             "random trunk trains heads on noise")
        if optim.cache_trunk and self.loss.early_exit is not None:
            raise ValueError(f"optim.cache_trunk=true keeps the trunk's final outputs, which "
                             f"loss.early_exit={self.loss.early_exit} cannot read (it needs "
                             f"layer {self.loss.early_exit - 1}'s): set loss.early_exit=null")
        steps = self.loss.schedule_steps
        if self.loss.schedule != "constant" and steps and max(steps) > self.run.max_steps:
            raise ValueError(f"loss.schedule_steps={list(steps)} must be within the run's "
                             f"trainer.max_steps={self.run.max_steps} (loss.schedule="
                             f"{self.loss.schedule})")
        if not optim.heads_only_steps < self.run.max_steps:
            raise ValueError(f"optim.heads_only_steps={optim.heads_only_steps} must be in "
                             f"[0, trainer.max_steps={self.run.max_steps})")

    def check_model(self, *, n_future: int, max_seq_len: int,
                    n_layers: int | None = None) -> None:
        """`LossSettings.check_model` and the checks across sections (n_layers None: unknown,
        as in a config whose trunk is `model.depth` less the heads' blocks)."""
        if self.run.seq_len > max_seq_len:
            raise ValueError(f"seq_len={self.run.seq_len} must be an integer in "
                             f"[1, model.max_seq_len={max_seq_len}]")
        self.loss.check_model(n_future=n_future, n_layers=n_layers)
        if self.optim.freeze_trunk and n_future == 1:
            raise ValueError("optim.freeze_trunk=true with model.n_future=1 leaves nothing to "
                             "train: set model.n_future above 1 (the heads to add)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain values (tuples, numbers, strings), for checkpoints' hyperparameters."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Mapping[str, Any]]) -> TrainSettings:
        """The settings `to_dict` gave (e.g. read back from a checkpoint)."""
        parts = {"run": RunSettings, "loss": LossSettings, "optim": OptimSettings,
                 "init": InitSettings, "decode": DecodeCheckSettings}
        return cls(**{name: _section(parts[name], values[name], name) for name in values})


def _section(kind: type, values: Mapping[str, Any], key: str) -> Any:
    """`kind(**values)`, an unknown key refused by name rather than with a TypeError."""
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a setting; {key} has "
                         f"{', '.join(sorted(names))}")
    return kind(**values)


def check_settings(cfg: DictConfig) -> TrainSettings:
    """The settings of a composed `conf/config.yaml`, built and checked against `cfg.model`
    (the `init_from` checkpoint's trunk is checked later, by `MTPLitModule`)."""
    def section(kind: type, key: str, **given: Any) -> Any:
        return _section(kind, {**given, **OmegaConf.to_container(cfg[key], resolve=True)}, key)

    trainer, fsdp = cfg.trainer, OmegaConf.to_container(cfg.fsdp, resolve=True)
    settings = TrainSettings(
        run=RunSettings(seq_len=cfg.seq_len, max_steps=trainer.get("max_steps"),
                        threads=cfg.threads, compile=cfg.compile,
                        activation_checkpointing=cfg.activation_checkpointing,
                        param_dtype=fsdp.get("param_dtype", "auto"),
                        reduce_dtype=fsdp.get("reduce_dtype", "float32"),
                        peak_flops=trainer.get("peak_flops")),
        loss=section(LossSettings, "loss"), optim=section(OptimSettings, "optim"),
        init=section(InitSettings, "init", init_from=cfg.init_from or None),
        decode=section(DecodeCheckSettings, "decode"))
    settings.check_model(n_future=cfg.model.n_future, max_seq_len=cfg.model.max_seq_len)
    return settings
