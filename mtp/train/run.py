"""`python -m mtp.train +experiment=byte8`: compose the config, train, export, summarise.

`train(cfg)` checks the settings, the files they name and whether a GPU step fits before
anything heavy runs; then it trains with Lightning, validates, exports (`mtp.load`), plots
`<run>/plots/`, measures greedy decoding (`decode.*`) and writes the summary.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from mtp.checkpoint import (META_FILE, check_vocab, export, is_sharded_checkpoint, load,
                            tokenizer_files)
from mtp.cli import check_choice
from mtp.data import build_tokenizer
from mtp.generate.measure import format_decoding
from mtp.model import MTPConfig
from mtp.paths import CONF_DIR, require_smollm2_gguf
from mtp.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer
from mtp.train.finetune import grow_heads, grown_config
from mtp.train.lit import MTPLitModule
from mtp.train.memory import check_fits, count_parameters, step_memory
from mtp.train.pace import PaceCheck, ThreadSearch, max_time_timer
from mtp.train.plots import MetricsHistory, write_plots
from mtp.train.quiet import quiet_logger, quiet_third_party
from mtp.train.settings import InitSettings, TrainSettings, check_settings
from mtp.train.summary import (decode_export, decode_metrics, decode_prompts, val_figures,
                               write_summary)
from mtp.tune import cpu_has_bf16, fingerprint, set_threads, tune_key


def _world_size(num_nodes: int, devices: Any) -> int:
    """Ranks of a run: `trainer.devices` may be "auto" (every visible GPU)."""
    per_node = torch.cuda.device_count() if devices in ("auto", -1) else int(devices)
    return int(num_nodes) * per_node


def cpu_precision() -> str:
    """bf16-mixed where the CPU multiplies bf16 natively (AVX512-BF16, AMX: a step about 1.4x
    faster), else 32-true (emulated bf16 is slower than float32)."""
    return "bf16-mixed" if cpu_has_bf16() else "32-true"


def decaying_weights(decay: float, n_future: int) -> ListConfig:
    """Per-head loss weights decay**i, i = 0..n_future-1 (Medusa-2's lambda^i)."""
    return OmegaConf.create([float(decay) ** i for i in range(int(n_future))])


def split_weight(total: float, n_future: int) -> ListConfig:
    """Per-head loss weights 1, then total / (n_future - 1) each: DeepSeek-V3's lambda / D."""
    extra = int(n_future) - 1
    return OmegaConf.create([1.0] + [float(total) / max(extra, 1)] * extra)


# The GPU presets' context per tokenizer. Bytes: the longest prompt of HumanEval (1,360 bytes)
# and zero-shot MBPP (4,398), plus the token that starts a document and eval's 512 new tokens,
# rounded up to a multiple of 1,024 (tests/test_configs.py checks it against both benchmarks).
CONTEXT = {"byte": 5120, "bpe": 2048}


def context(tokenizer_kind: str) -> int:
    """`model.max_seq_len` of the model presets 50m..400m for `tokenizer.kind`."""
    return CONTEXT[check_choice("tokenizer.kind", tokenizer_kind, sorted(CONTEXT))]


def lr_for_width(dim: int) -> float:
    """The GPU recipes' peak learning rate: 1e-3 at width 512, times 512 / width (muP's
    scaling for Adam; near GPT-3's table: 6e-4 at 768, 2e-4 at 2,048)."""
    return 1e-3 * 512 / int(dim)


# The errors a user's input raises: the command prints them in one line.
USER_ERRORS = (ValueError, FileNotFoundError)

for _name, _resolver in {"world_size": _world_size, "decaying_weights": decaying_weights,
                         "split_weight": split_weight, "cpu_precision": cpu_precision,
                         "context": context, "lr_for_width": lr_for_width,
                         "smollm2_gguf": require_smollm2_gguf}.items():
    OmegaConf.register_new_resolver(f"mtp.{_name}", _resolver, replace=True)


def compose(overrides: list[str] = ()) -> DictConfig:
    """The config `python -m mtp.train *overrides` would run (pass `run_dir=...` too)."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose(config_name="config", overrides=list(overrides))


def model_config(cfg: DictConfig, tokenizer: Tokenizer) -> MTPConfig:
    """The model's `MTPConfig` from `cfg.model`, its vocabulary the tokenizer's."""
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    _check_model_vocab(fields.get("vocab_size"), tokenizer, f"tokenizer={tokenizer.name}")
    fields["vocab_size"] = tokenizer.vocab_size
    config = instantiate(fields)
    check_vocab(config, tokenizer)
    return config


def _check_model_vocab(vocab_size: int | None, tokenizer: Tokenizer, whose: str) -> None:
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} does not match {whose}'s vocab_size="
                         f"{tokenizer.vocab_size}; leave model.vocab_size=null to take the "
                         f"tokenizer's")


def check_init_tokenizer(cfg: DictConfig, tokenizer: Tokenizer) -> None:
    """Fail unless the `init_from` checkpoint's tokenizer is the configured one."""
    kind, source = cfg.tokenizer.kind, f"init_from={cfg.init_from}"
    if (kind == "byte") != isinstance(tokenizer, ByteTokenizer):
        raise ValueError(f"{source} has a {tokenizer.name} tokenizer (vocab_size="
                         f"{tokenizer.vocab_size}) but tokenizer={kind} is configured: "
                         f"choose the checkpoint's (tokenizer=byte or tokenizer=bpe)")
    if kind == "bpe":
        if cfg.tokenizer.get("path"):
            configured = load_tokenizer(cfg.tokenizer.path)
            if configured.fingerprint != tokenizer.fingerprint:
                raise ValueError(f"{source} has another BPE tokenizer than tokenizer.path="
                                 f"{cfg.tokenizer.path} (vocab_size {tokenizer.vocab_size} vs "
                                 f"{configured.vocab_size}, or different merges)")
        elif cfg.tokenizer.vocab_size not in (None, tokenizer.vocab_size):  # None: the checkpoint's
            raise ValueError(f"{source} has a BPE vocabulary of {tokenizer.vocab_size} tokens "
                             f"but tokenizer.vocab_size={cfg.tokenizer.vocab_size} is configured")
    _check_model_vocab(cfg.model.get("vocab_size"), tokenizer, source)


def grown_model(cfg: DictConfig, init: InitSettings
                ) -> tuple[Tokenizer, MTPConfig, dict[str, torch.Tensor]]:
    """The `init_from` checkpoint's tokenizer, the grown config and its initial weights."""
    base, tokenizer = load(init.init_from)
    check_init_tokenizer(cfg, tokenizer)
    config = grown_config(base.config, n_future=cfg.model.n_future,
                          head_type=cfg.model.head_type, drop_heads=init.drop_heads,
                          new_heads=init.new_heads)
    state = grow_heads(base, config, new_heads=init.new_heads)
    kept = min(config.n_future, base.config.n_future)
    added = (f"heads {kept}..{config.n_future - 1} added ({config.head_type}, "
             f"{init.new_heads})" if config.n_future > kept else "no heads added")
    rank_zero_info(f"init_from {init.init_from}: {config.n_layers}-layer trunk and heads "
                   f"0..{kept - 1} kept, {added}; the architecture is the checkpoint's "
                   f"(model.* other than n_future and head_type is not used)")
    return tokenizer, config, state


def check_device_memory(cfg: DictConfig, settings: TrainSettings, config: MTPConfig) -> None:
    """Refuse, before any data, a GPU run whose step cannot fit (`mtp.train.memory`)."""
    if cfg.trainer.get("accelerator") not in ("gpu", "cuda", "auto") or \
            not torch.cuda.is_available():
        return
    sharded = cfg.trainer.get("strategy") is not None
    ranks = _world_size(cfg.trainer.num_nodes, cfg.trainer.devices) if sharded else 1
    run = settings.run
    memory = step_memory(config, batch=cfg.data.batch_size, seq_len=run.seq_len,
                         loss_mode=settings.loss.mode, ranks=ranks,
                         activation_checkpointing=run.activation_checkpointing,
                         freeze_trunk=settings.optim.freeze_trunk)
    device = torch.cuda.get_device_properties(0)
    choice = HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None
    parameters = count_parameters(config)[0]
    what = (f"{f'model={choice}' if choice else 'the model'} ({parameters / 1e6:.1f}M parameters) "
            f"at data.batch_size={cfg.data.batch_size} x seq_len={run.seq_len}")
    check_fits(memory, capacity=device.total_memory, device=f"cuda:0 ({device.name})", what=what)


def check_resumable(ckpt_path: str | None) -> None:
    """Refuse, before anything is built, a `ckpt_path` that is not a Lightning checkpoint of
    `mtp.train`; read `weights_only=True` (no code runs) and memory-mapped."""
    if not ckpt_path:
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise ValueError(f"ckpt_path={ckpt_path} does not exist")
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise ValueError(f"ckpt_path={ckpt_path} is a folder but not a sharded checkpoint "
                         f"(trainer=fsdp writes one with {META_FILE} and .metadata)")
    try:
        checkpoint = torch.load(path / META_FILE if path.is_dir() else path,
                                map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises many kinds for a foreign or truncated file
        raise ValueError(f"ckpt_path={ckpt_path} is not a Lightning checkpoint: it does not "
                         f"load as tensors and plain values ({type(error).__name__})") from None
    hyper = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(hyper, dict) or "model" not in hyper \
            or "pytorch-lightning_version" not in checkpoint:
        raise ValueError(f"ckpt_path={ckpt_path} is not a checkpoint that mtp.train wrote: it "
                         f"has no model config in Lightning's hyper_parameters")


def _logger(cfg: DictConfig) -> Any:
    if not cfg.logger or cfg.logger.get("_target_") is None:
        return False
    # Offline unless the user chose otherwise: no login and no network needed.
    os.environ.setdefault("WANDB_MODE", "offline")
    logger = instantiate(cfg.logger)
    quiet_logger(logger)
    return logger


def build_trainer(cfg: DictConfig, **kwargs: Any) -> L.Trainer:
    """The `lightning.Trainer` that `cfg.trainer` describes, with `kwargs` (logger, callbacks)."""
    fields = OmegaConf.to_container(cfg.trainer, resolve=True)
    fields.pop("peak_flops", None)  # mtp's setting (the MFU denominator), not the Trainer's
    return instantiate(fields, **kwargs)


def pace_callbacks(cfg: DictConfig, settings: TrainSettings, config: MTPConfig
                   ) -> list[Callback]:
    """On a CPU, the thread search and the early warning of `mtp.train.pace`; GPU recipes
    are planned in time (`trainer.max_steps` is a ceiling there), so they get neither."""
    run = settings.run
    if str(cfg.trainer.get("accelerator")) != "cpu":
        if run.threads:
            set_threads(run.threads)
        return []
    key = tune_key("threads", kind="train", model=fingerprint(config.to_dict()),
                   width=run.seq_len, batch=cfg.data.batch_size,
                   dtype=str(cfg.trainer.precision), device="cpu")
    search = ThreadSearch(key, requested=run.threads)
    return [search, PaceCheck(run.max_steps, run.seq_len, settings.optim.accumulate, search)]


def early_stop_reason(trainer: L.Trainer, max_steps: int) -> str | None:
    """Why `trainer.fit` ended before `max_steps` optimizer steps; None if it did not."""
    if trainer.global_step >= max_steps:
        return None
    timer = max_time_timer(trainer)
    if timer and timer.time_remaining() <= 0:
        elapsed = timer.time_elapsed()
        budget = elapsed + timer.time_remaining()
        return (f"the trainer.max_time guard ({timedelta(seconds=round(budget))}) stopped "
                f"training after {timedelta(seconds=round(elapsed))}")
    if trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
        return f"the data ran out after trainer.max_epochs={trainer.max_epochs} epoch(s)"
    return "a callback asked the trainer to stop"


def _print_summary(trainer: L.Trainer, result: dict[str, Any], path: Path) -> None:
    """The run's end in the terminal: `result` (summary.json's) as tables and paths."""
    val = result["val"]
    if val:
        lines = ["", "head  predicts  val loss  val acc",
                 *(f"{i:>4}  t+{i + 1:<7} {loss:>8.4f}  {accuracy:>7.4f}"
                   for i, (loss, accuracy) in enumerate(zip(val["loss_head"], val["acc_head"])))]
    else:
        lines = ["", "no validation data (raise data.val_fraction for a per-head summary)"]
    if result["decode"]:
        lines += ["", *format_decoding(result["decode"])]
    stopped, steps, max_steps = result["stopped_early"], result["steps"], result["max_steps"]
    if stopped:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        lr, peak = scheduler.get_last_lr()[0], scheduler.base_lrs[0]
        lines += ["", f"stopped early at step {steps} of trainer.max_steps={max_steps}:",
                  f"  {stopped};", f"  the learning rate had come down to {lr:.3g} "
                  f"({lr / peak:.0%} of its peak): the schedule ends by the time budget too"]
        if stopped.startswith("the trainer.max_time guard"):
            lines.append(f"  the model is undertrained: {steps / max_steps:.0%} of the recipe "
                         f"ran ({steps} of {max_steps} steps)")
    lines += ["", f"resume:   ckpt_path={result['checkpoint']}", f"exported: {result['export']}",
              f"   load:  mtp.load({result['export']!r})", f"plots:    {result['plots']}",
              f"summary:  {path}"]
    print("\n".join(lines), flush=True)


def train(cfg: DictConfig) -> Path:
    """Train as `cfg` (the composed `conf/config.yaml`) says; return the export directory."""
    settings = check_settings(cfg)
    check_resumable(cfg.ckpt_path)
    source = instantiate(cfg.data.source)  # a local source's globs must match files: here
    quiet_third_party()
    torch.set_float32_matmul_precision("high")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = Path(cfg.run_dir)

    if settings.init.init_from:
        tokenizer, config, init_state = grown_model(cfg, settings.init)
    else:
        tokenizer = build_tokenizer(
            **OmegaConf.to_container(cfg.tokenizer, resolve=True), source=source,
            val_fraction=cfg.data.val_fraction, seed=cfg.data.seed, cache_dir=cfg.data.cache_dir)
        config, init_state = model_config(cfg, tokenizer), None
    prompts = decode_prompts(settings.decode, config, tokenizer)
    if settings.decode.enabled and not prompts:
        rank_zero_warn(f"no HumanEval prompt leaves decode.max_new_tokens="
                       f"{settings.decode.max_new_tokens} in model.max_seq_len="
                       f"{config.max_seq_len}: this run will not measure decoding "
                       f"(decode.enabled=false silences this)")
    check_device_memory(cfg, settings, config)
    lit = MTPLitModule(config, settings, tokenizer_files=tokenizer_files(tokenizer),
                       init_state=init_state)
    # Blocks carry the look-ahead the loss reads: n_future tokens, or loss.ahead's.
    datamodule = instantiate(cfg.data, tokenizer=tokenizer, seq_len=settings.run.seq_len,
                             n_future=settings.loss.lookahead(config.n_future))

    logger = _logger(cfg)
    checkpointing, history = ModelCheckpoint(
        dirpath=run_dir / "checkpoints", filename="step{step:07d}", auto_insert_metric_name=False,
        every_n_train_steps=cfg.checkpoint.every_n_steps, save_top_k=cfg.checkpoint.keep,
        monitor="step", mode="max", save_last=True), MetricsHistory()
    trainer = build_trainer(cfg, logger=logger,
                            callbacks=[checkpointing, history,
                                       *pace_callbacks(cfg, settings, config)],
                            default_root_dir=str(run_dir))
    if logger:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    trainer.fit(lit, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = trainer.validate(lit, datamodule=datamodule, verbose=False)

    export_dir = export(lit.model, tokenizer, run_dir / "export")
    max_steps, plots, result, decode = settings.run.max_steps, run_dir / "plots", None, None
    if trainer.is_global_zero:
        write_plots(history.history, plots)
        if prompts:  # one process decodes; the others wait at the barrier below
            decode = decode_export(export_dir, trainer.strategy.root_device, settings.decode,
                                   prompts)
            if logger:
                logger.log_metrics(decode_metrics(decode), step=trainer.global_step)
                logger.save()
        result = {
            "run_dir": str(run_dir), "export": str(export_dir),
            "checkpoint": checkpointing.last_model_path, "plots": str(plots),
            "steps": trainer.global_step, "max_steps": max_steps,
            "stopped_early": early_stop_reason(trainer, max_steps),
            "recipe_fraction": round(trainer.global_step / max_steps, 3),
            "threads": torch.get_num_threads(),
            "parameters": count_parameters(config)[0],
            "val": val_figures(metrics, config.n_future), "decode": decode}
        path = write_summary(run_dir, result)
    trainer.strategy.barrier()
    if result is not None:  # rank zero's
        _print_summary(trainer, result, path)
    return export_dir


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    # A setting, file or checkpoint that cannot serve: one line (as `mtp.cli`), no traceback.
    try:
        train(cfg)
    except InterpolationResolutionError as error:  # e.g. ${mtp.smollm2_gguf:}: its message
        sys.exit(f"error: {str(error).splitlines()[0]}")
    except InstantiationException as error:  # a config object's own error, in one line
        if not isinstance(error.__cause__, USER_ERRORS):
            raise
        sys.exit(f"error: {error.__cause__}")
    except USER_ERRORS as error:
        sys.exit(f"error: {error}")
