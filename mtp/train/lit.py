"""The LightningModule: manual optimisation around `mtp.train.loss.mtp_loss`, whose headwise
modes run their own backward passes (one per head, then the trunk's) via `manual_backward`.

One optimizer step is `accumulate` micro-batches, each weighted 1/accumulate; the schedules
count optimizer steps and also end by `trainer.max_time` (Lightning's `Timer`, which
checkpoints restore). Under FSDP2 the model is built on the meta device, sharded, initialised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from mtp.model import MTPConfig, MTPModel
from mtp.train.flops import flops_per_token, mfu, resolve_peak_flops
from mtp.train.loss import LossOutput, mtp_loss
from mtp.train.optim import LRSchedule, build_optimizer, build_scheduler, schedules
from mtp.train.pace import max_time_timer
from mtp.train.parallel import (apply_activation_checkpointing, gradient_sync, mixed_precision,
                                parallelize)
from mtp.train.schedule import Progress
from mtp.train.settings import TrainSettings
from mtp.train.trunk_cache import TrunkCache


def compile_blocks(model: MTPModel) -> None:
    """`torch.compile` every transformer block of `model` in place (trunk and heads): per
    block, as torchtitan, FSDP2 units and parameter names stay as they are."""
    for block in [*model.layers, *(b for head in model.heads for b in head)]:
        block.compile()


class NonFiniteLossError(RuntimeError):
    """Raised when a step's loss or gradient norm is not finite; no bad state is saved."""


class MTPLitModule(L.LightningModule):
    """Trains an `MTPModel` of `model` with the multi-token loss; `model` and `settings` may
    be their `to_dict()`s (as a checkpoint stores them), `tokenizer_files` (name -> text) go
    into every checkpoint, `init_state` is a full state dict (e.g. `finetune.grow_heads`)."""

    def __init__(self, model: MTPConfig | Mapping[str, Any],
                 settings: TrainSettings | Mapping[str, Any], *,
                 tokenizer_files: dict[str, str] | None = None,
                 init_state: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.config = model if isinstance(model, MTPConfig) else MTPConfig.from_dict(dict(model))
        self.settings = settings if isinstance(settings, TrainSettings) \
            else TrainSettings.from_dict(settings)
        self.settings.check_model(n_future=self.config.n_future,
                                  max_seq_len=self.config.max_seq_len,
                                  n_layers=self.config.n_layers)
        self.save_hyperparameters({"model": self.config.to_dict(),
                                   "settings": self.settings.to_dict()})
        self.trunk_cache = TrunkCache() if self.settings.optim.cache_trunk else None
        self.automatic_optimization = False
        self._init_state = init_state
        self.tokenizer_files = dict(tokenizer_files or {})
        self.model: MTPModel | None = None
        self._step_started: float | None = None
        self._schedules: list[LRSchedule] = []
        self._weights_at = Progress()  # where the last loss read its scheduled weights
        self._flops_per_token = flops_per_token(
            self.config, self.settings.run.seq_len,
            trains_base=not self.settings.optim.freeze_trunk)
        self._peak_flops: float | None = None  # per device; resolved when training starts

    # -- model ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the model: plain, or on the meta device and FSDP2-sharded under a mesh."""
        if self.model is not None:  # Lightning may call this more than once
            return
        mesh, run = self._device_mesh, self.settings.run
        if mesh is not None and mesh.ndim > 1 and mesh["tensor_parallel"].size() > 1:
            raise ValueError(f"tensor parallelism is not supported: the strategy's mesh is "
                             f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}; set "
                             f"strategy.tensor_parallel_size=1")
        with torch.device("meta") if mesh is not None else contextlib.nullcontext():
            model = MTPModel(self.config)
        apply_activation_checkpointing(model, run.activation_checkpointing)
        if run.compile:
            compile_blocks(model)
        if mesh is not None:
            policy = mixed_precision(self.trainer.precision, param_dtype=run.param_dtype,
                                     reduce_dtype=run.reduce_dtype)
            parallelize(model, mesh["data_parallel"] if mesh.ndim > 1 else mesh, mp_policy=policy)
            model.to_empty(device=self.device)
            model.init_weights()
        if self._init_state is not None:
            set_model_state_dict(model, self._init_state,
                                 options=StateDictOptions(full_state_dict=True, strict=True))
            self._init_state = None  # the weights are in the model now; free the copy
        if self.settings.optim.freeze_trunk:
            for name, param in model.named_parameters():
                if MTPModel.is_base_parameter(name):
                    param.requires_grad_(False)
        self.model = model

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.settings.optim
        optimizer = build_optimizer(self.model, optim)
        # The whole budget (elapsed + remaining): a resumed run's Timer may be restored already.
        scheduler = build_scheduler(optimizer, warmup_steps=optim.warmup_steps,
                                    total_steps=self.settings.run.max_steps,
                                    min_lr_ratio=optim.min_lr_ratio,
                                    heads_only_steps=optim.heads_only_steps,
                                    time_budget=self._progress().time_budget)
        self._schedules = schedules(scheduler)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}

    def _progress(self) -> Progress:
        """The run's optimizer step and, under `trainer.max_time`, its clock (each rank reads
        its own Timer: no collective per step)."""
        timer = max_time_timer(self.trainer) if self._trainer is not None else None
        elapsed = timer.time_elapsed() if timer else 0.0
        return Progress(step=self.global_step, max_steps=self.settings.run.max_steps,
                        elapsed=elapsed, time_budget=timer and elapsed + timer.time_remaining())

    def on_fit_start(self) -> None:
        if "16-mixed" == str(self.trainer.precision):
            raise ValueError("precision=16-mixed needs a gradient scaler, which manual "
                             "optimisation here does not run: use bf16-mixed or 32-true")
        # Here, not in the settings: "cpu" measures this CPU in the trainer's precision.
        self._peak_flops = resolve_peak_flops(self.settings.run.peak_flops,
                                              str(self.trainer.precision))

    # -- steps ------------------------------------------------------------------------------

    def _loss(self, tokens: torch.Tensor, *, train: bool,
              index: torch.Tensor | None = None) -> LossOutput:
        """The loss of a batch (backpropagated when `train`); `index` names a training batch's
        blocks for `cache_trunk`'s cache."""
        seq_len = self.settings.run.seq_len
        lookahead = self.settings.loss.lookahead(self.config.n_future)
        if tokens.ndim != 2 or tokens.shape[1] != seq_len + lookahead:
            raise ValueError(f"batch['tokens'] has shape {tuple(tokens.shape)}; expected "
                             f"(batch, seq_len + look-ahead = {seq_len} + {lookahead} = "
                             f"{seq_len + lookahead}: n_future heads, or 1 + len(loss.ahead))")
        trunk_out = None
        if train and self.trunk_cache is not None:
            if index is None:
                raise ValueError("cache_trunk needs each training block's index (batch['index'],"
                                 " from a map-style corpus; a streamed one has none)")
            trunk_out = self.trunk_cache.trunk_out(self.model, tokens[:, :seq_len], index)
        scale = 1.0 / self.settings.optim.accumulate if train else 1.0
        self._weights_at = self._progress()
        settings = self.settings.loss.resolved(self.config.n_future, self._weights_at, scale)
        return mtp_loss(self.model, tokens, settings, seq_len=seq_len,
                        backward=self.manual_backward if train else None,
                        train_trunk=self._trains_trunk(), trunk_out=trunk_out)

    def _trains_trunk(self) -> bool:
        optim = self.settings.optim
        return not optim.freeze_trunk and self.global_step >= optim.heads_only_steps

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        optim = self.settings.optim
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        last = (batch_idx + 1) % optim.accumulate == 0
        if batch_idx % optim.accumulate == 0:  # a step's first micro-batch
            self._step_started = time.perf_counter()
        # Under FSDP, one reduce-scatter per parameter per step; without a trunk backward
        # (frozen, warming up) every unit syncs in each of its backwards, FSDP's plain rule.
        headwise = self.settings.loss.mode != "naive" and self._trains_trunk()
        with gradient_sync(self.model, sync=last, headwise=headwise):
            out = self._loss(batch["tokens"], train=True, index=batch.get("index"))
        metrics = _metrics(out, loss_scale=optim.accumulate)  # undo 1/accumulate for the log
        self._check_finite("loss", metrics["loss"], out)
        # The whole batch's losses and accuracies, not rank 0's share: one all-reduce over ranks.
        values = self.trainer.strategy.reduce(torch.stack(list(metrics.values())),
                                              reduce_op="mean")
        self._log_metrics("train", dict(zip(metrics, values)))
        if self.settings.loss.schedule != "constant":
            self._log_weights()
        if not last:
            return

        if optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self._check_finite("gradient norm", norm, out)
            self.log("train/grad_norm", norm)
        lrs = dict(zip((group["name"] for group in optimizer.param_groups),
                       scheduler.get_last_lr()))
        self.log("train/lr", lrs.get("heads", lrs.get("base")), prog_bar=True)
        if optim.base_lr_mult != 1.0 or optim.heads_only_steps:
            self.log("train/lr_trunk", lrs["base"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress = self._progress()
        if progress.time_budget is not None:  # the schedules' clock
            for schedule in self._schedules:
                schedule.elapsed, schedule.time_budget = progress.elapsed, progress.time_budget
        scheduler.step()

        seconds = time.perf_counter() - (self._step_started or time.perf_counter())
        tokens = (optim.accumulate * batch["tokens"].shape[0] * self.settings.run.seq_len
                  * self.trainer.world_size)
        rate = tokens / max(seconds, 1e-9)
        self.log("train/tokens_per_sec", rate, prog_bar=True)
        if self._peak_flops:
            peak = self._peak_flops * self.trainer.world_size
            self.log("train/mfu", mfu(rate, self._flops_per_token, peak))

    def _check_finite(self, what: str, value: torch.Tensor, out: LossOutput) -> None:
        bad = not torch.isfinite(value).item()
        if self.trainer.world_size > 1:  # every rank must stop together
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            raise NonFiniteLossError(
                f"non-finite {what} ({value.item()}) at step {self.global_step}, "
                f"per-head losses {out.head_losses.tolist()}; stopping without saving this "
                f"state. Lower optim.lr or raise optim.warmup_steps, and resume from the last "
                f"good checkpoint (ckpt_path=.../checkpoints/last.ckpt).")

    def _log_weights(self) -> None:
        """The loss weights this step used: the schedule, plotted beside the losses."""
        loss, n, progress = self.settings.loss, self.config.n_future, self._weights_at
        for i, weight in enumerate(loss.head_weights(n, progress)[1:], start=1):
            self.log(f"train/loss_weight_head{i}", weight)
        for d, weight in enumerate(loss.ahead_weights(n, progress), start=1):
            self.log(f"train/loss_weight_ahead{d}", weight)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self._loss(batch["tokens"], train=False)
        self._log_metrics("val", _metrics(out), sync_dist=True,
                          batch_size=batch["tokens"].shape[0])

    def _log_metrics(self, split: str, metrics: dict[str, torch.Tensor], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(f"{split}/{name}", value, prog_bar=name == "loss", **kwargs)

    # -- checkpoints ------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokenizer_files"] = self.tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokenizer_files = checkpoint.get("tokenizer_files", self.tokenizer_files)


def _metrics(out: LossOutput, loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A loss's logged figures by name (after "train/" or "val/"), the total `loss` first."""
    metrics = {"loss": out.loss * loss_scale}
    for i, (loss, accuracy) in enumerate(zip(out.head_losses, out.head_accuracy)):
        metrics[f"loss_head{i}"], metrics[f"acc_head{i}"] = loss, accuracy
    if out.ahead_losses is not None:
        for d, (loss, accuracy) in enumerate(zip(out.ahead_losses, out.ahead_accuracy), 1):
            metrics[f"loss_ahead{d}"], metrics[f"acc_ahead{d}"] = loss, accuracy
    if out.exit_loss is not None:
        metrics["loss_exit"] = out.exit_loss
        metrics["acc_exit"] = out.exit_correct / out.head_count[0].clamp(min=1)
    return metrics
