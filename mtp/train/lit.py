"""The LightningModule: manual optimisation around `mtp.train.loss.mtp_loss`.

Manual optimisation, because the headwise loss runs its own backward passes (one per head,
then one through the trunk) through `manual_backward`; Lightning's automatic loop would want
a single loss tensor and so the naive, n-times-the-logits-memory backward.

One optimizer step = `accumulate` micro-batches; each is weighted 1/accumulate so the
gradient is the mean over them. `trainer.global_step` counts optimizer steps, so
`trainer.max_steps` and the LR schedule are in optimizer steps. The schedule also ends by
`trainer.max_time` when that comes first (`mtp.train.optim.lr_factor`): its clock is Lightning's
`Timer`, which checkpoints restore, so a resumed run continues the same schedule.
Under FSDP2 the model is built on the meta device, sharded by `mtp.train.parallel.parallelize`
and then initialised.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from mtp.train.flops import flops_per_token, mfu
from mtp.train.loss import LOSS_MODES, LossOutput, check_early_exit, mtp_loss
from mtp.model import MTPConfig, MTPModel
from mtp.train.optim import LRSchedule, build_optimizer, build_scheduler, schedules
from mtp.train.parallel import (apply_activation_checkpointing, check_options, gradient_sync,
                          mixed_precision, parallelize)
from mtp.train.trunk_cache import TrunkCache


def compile_blocks(model: MTPModel) -> None:
    """`torch.compile` every transformer block of `model` in place (trunk and heads)."""
    # Per block (torchtitan's choice): FSDP2 units stay intact, compile time is one block's,
    # and parameter names are unchanged (checkpoints stay portable).
    for block in [*model.layers, *(b for head in model.heads for b in head)]:
        block.compile()


class NonFiniteLossError(RuntimeError):
    """Raised when a step's loss or gradient norm is not finite; no bad state is saved."""


class MTPLitModule(L.LightningModule):
    """Trains an `MTPModel` with the multi-token loss.

    Args:
        model: `MTPConfig.to_dict()` of the model to train (JSON-safe, saved in checkpoints).
        seq_len: input tokens per block; batches are (B, seq_len + n_future).
        loss_mode: "headwise", "naive" or "chunked" (see `mtp.train.loss`); same gradients.
        loss_weights: per-head weights (default all 1).
        early_exit, early_exit_weight: LayerSkip's early-exit term at that trunk layer, with
            that weight (`mtp.train.loss`); None: none.
        lr, weight_decay, betas, eps: AdamW; no decay on norm gains or biases.
        warmup_steps, min_lr_ratio: linear warm-up, then cosine down to lr * min_lr_ratio at
            `max_steps` (default: the trainer's max_steps) or at the trainer's `max_time`,
            whichever comes first.
        grad_clip: max global gradient norm (0 turns clipping off).
        accumulate: micro-batches per optimizer step.
        compile: `torch.compile` every transformer block.
        activation_checkpointing: "none", "trunk" or "all": blocks that recompute their
            activations in backward (`mtp.train.parallel.apply_activation_checkpointing`).
        param_dtype, reduce_dtype: FSDP2's mixed precision under a device mesh
            (`mtp.train.parallel.mixed_precision`; "auto" follows the trainer's precision).
        peak_flops: the hardware's peak FLOPs/s per device, to log `train/mfu` against
            (`mtp.train.flops`); None logs no MFU.
        tokenizer_files: the tokenizer's saved files (name -> text), stored in every
            checkpoint so a `.ckpt` alone can be loaded for inference.
        init_state: initial weights (a full state dict, e.g. `mtp.train.finetune.grow_heads`)
            instead of random ones; not saved in the hyperparameters.
        freeze_trunk: Medusa-1: the base model (`MTPModel.is_base_parameter`) gets no
            gradients, no optimizer state and no backward pass; only heads 1..n-1 train.
        trunk_lr_mult: the base model's learning rate over the heads' (Medusa-2).
        heads_only_steps: optimizer steps at the start in which only heads 1..n-1 train (the
            trunk is not backpropagated and the base's learning rate is 0).
        cache_trunk: with `freeze_trunk`, each training block's trunk output is computed once
            and kept (`mtp.train.trunk_cache`): later epochs run the heads alone.
    """

    def __init__(self, model: dict[str, Any], *, seq_len: int, loss_mode: str = "headwise",
                 loss_weights: list[float] | None = None, lr: float = 3e-3,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, warmup_steps: int = 100, min_lr_ratio: float = 0.1,
                 max_steps: int | None = None, grad_clip: float = 1.0, accumulate: int = 1,
                 compile: bool = False, activation_checkpointing: str = "none",
                 param_dtype: str = "auto", reduce_dtype: str = "float32",
                 tokenizer_files: dict[str, str] | None = None,
                 init_state: dict[str, torch.Tensor] | None = None, freeze_trunk: bool = False,
                 trunk_lr_mult: float = 1.0, heads_only_steps: int = 0,
                 peak_flops: float | None = None, early_exit: int | None = None,
                 early_exit_weight: float = 1.0, cache_trunk: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer_files", "init_state"])
        self.config = MTPConfig.from_dict(dict(model))
        if not isinstance(seq_len, int) or not 1 <= seq_len <= self.config.max_seq_len:
            raise ValueError(f"seq_len={seq_len!r} must be an integer in "
                             f"[1, model.max_seq_len={self.config.max_seq_len}]")
        if loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode={loss_mode!r} is not one of {LOSS_MODES}")
        if loss_weights is not None and len(loss_weights) != self.config.n_future:
            raise ValueError(f"loss_weights={list(loss_weights)} must have one weight per head "
                             f"(model.n_future={self.config.n_future})")
        check_early_exit(early_exit, early_exit_weight, self.config.n_layers)
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate={accumulate!r} must be a positive integer")
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be >= 0")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops={peak_flops!r} must be > 0 FLOPs/s (or None)")
        check_options(activation_checkpointing=activation_checkpointing,
                      param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        if freeze_trunk and (trunk_lr_mult != 1.0 or heads_only_steps):
            raise ValueError(f"a frozen trunk has no optimizer group: trunk_lr_mult="
                             f"{trunk_lr_mult} and heads_only_steps={heads_only_steps} would "
                             f"train it (leave them unset, or freeze_trunk=False for Medusa-2)")
        if freeze_trunk and self.config.n_future == 1:
            raise ValueError("freeze_trunk=True with model.n_future=1 leaves nothing to train")
        if cache_trunk and (not freeze_trunk or early_exit is not None):
            raise ValueError(f"cache_trunk=True keeps a frozen trunk's outputs: it needs "
                             f"freeze_trunk=True and no early exit (got freeze_trunk="
                             f"{freeze_trunk}, early_exit={early_exit})")
        self.trunk_cache = TrunkCache() if cache_trunk else None
        self.automatic_optimization = False
        self._init_state = init_state
        self.tokenizer_files = dict(tokenizer_files or {})
        self.model: MTPModel | None = None
        self._step_started: float | None = None
        self._schedules: list[LRSchedule] = []
        self._flops_per_token = flops_per_token(self.config, seq_len)

    # -- model ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the model: plain, or on the meta device and FSDP2-sharded under a mesh."""
        if self.model is not None:  # Lightning may call this more than once
            return
        mesh = self._device_mesh
        if mesh is None:
            model = MTPModel(self.config)
            apply_activation_checkpointing(model, self.hparams.activation_checkpointing)
            self._maybe_compile(model)
        else:
            if mesh.ndim > 1 and mesh["tensor_parallel"].size() > 1:
                raise ValueError(f"tensor parallelism is not supported: the strategy's mesh is "
                                 f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}; set "
                                 f"strategy.tensor_parallel_size=1")
            with torch.device("meta"):
                model = MTPModel(self.config)
            apply_activation_checkpointing(model, self.hparams.activation_checkpointing)
            self._maybe_compile(model)
            policy = mixed_precision(self.trainer.precision, param_dtype=self.hparams.param_dtype,
                                     reduce_dtype=self.hparams.reduce_dtype)
            parallelize(model, mesh["data_parallel"] if mesh.ndim > 1 else mesh, mp_policy=policy)
            model.to_empty(device=self.device)
            model.init_weights()
        if self._init_state is not None:
            set_model_state_dict(model, self._init_state,
                                 options=StateDictOptions(full_state_dict=True, strict=True))
            self._init_state = None  # the weights are in the model now; free the copy
        if self.hparams.freeze_trunk:
            for name, param in model.named_parameters():
                if MTPModel.is_base_parameter(name):
                    param.requires_grad_(False)
        self.model = model

    def _maybe_compile(self, model: MTPModel) -> None:
        if self.hparams.compile:
            compile_blocks(model)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        max_steps = hp.max_steps or self.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError(f"the LR schedule needs a step budget: set trainer.max_steps "
                             f"(got {max_steps!r})")
        optimizer = build_optimizer(self.model, lr=hp.lr, weight_decay=hp.weight_decay,
                                    betas=tuple(hp.betas), eps=hp.eps,
                                    trunk_lr_mult=hp.trunk_lr_mult)
        timer = self._timer()
        # The whole budget (elapsed + remaining): a resumed run's Timer may be restored already.
        budget = timer and timer.time_elapsed() + timer.time_remaining()
        scheduler = build_scheduler(optimizer, warmup_steps=hp.warmup_steps,
                                    total_steps=max_steps, min_lr_ratio=hp.min_lr_ratio,
                                    heads_only_steps=hp.heads_only_steps, time_budget=budget)
        self._schedules = schedules(scheduler)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}

    def _timer(self) -> Timer | None:
        """The trainer's `max_time` guard, when it has one."""
        timers = [cb for cb in self.trainer.callbacks
                  if isinstance(cb, Timer) and cb.time_remaining() is not None]
        return timers[0] if timers else None

    def _update_schedule_clock(self) -> None:
        """Give the LR schedule the training time so far.

        Each rank reads its own Timer (started together, milliseconds apart): no collective
        per step, and under FSDP each rank only updates its own shards anyway.
        """
        timer = self._timer()
        if timer is None or not self._schedules:
            return
        elapsed = timer.time_elapsed()
        budget = elapsed + timer.time_remaining()
        for schedule in self._schedules:
            schedule.elapsed, schedule.time_budget = elapsed, budget

    def on_fit_start(self) -> None:
        if "16-mixed" == str(self.trainer.precision):
            raise ValueError("precision=16-mixed needs a gradient scaler, which manual "
                             "optimisation here does not run: use bf16-mixed or 32-true")

    # -- steps ------------------------------------------------------------------------------

    def _loss(self, tokens: torch.Tensor, *, train: bool,
              index: torch.Tensor | None = None) -> LossOutput:
        """The loss of a batch (backpropagated when `train`); a training batch's `index` (its
        blocks') reads the frozen trunk's output from `cache_trunk`'s cache."""
        hp = self.hparams
        expected = hp.seq_len + self.config.n_future
        if tokens.ndim != 2 or tokens.shape[1] != expected:
            raise ValueError(f"batch['tokens'] has shape {tuple(tokens.shape)}; expected "
                             f"(batch, seq_len + n_future = {hp.seq_len} + "
                             f"{self.config.n_future} = {expected})")
        weights = hp.loss_weights or [1.0] * self.config.n_future
        exit_weight = hp.early_exit_weight
        if train:  # the mean over micro-batches, not the sum
            weights = [w / hp.accumulate for w in weights]
            exit_weight /= hp.accumulate
        trunk_out = None
        if train and self.trunk_cache is not None:
            if index is None:
                raise ValueError("cache_trunk needs each training block's index (batch['index'],"
                                 " from a map-style corpus; a streamed one has none)")
            trunk_out = self.trunk_cache.trunk_out(self.model, tokens[:, :hp.seq_len], index)
        return mtp_loss(self.model, tokens, seq_len=hp.seq_len, mode=hp.loss_mode,
                        weights=weights, backward=self.manual_backward if train else None,
                        train_trunk=self._trains_trunk(), early_exit=hp.early_exit,
                        early_exit_weight=exit_weight, trunk_out=trunk_out)

    def _trains_trunk(self) -> bool:
        """Whether this step backpropagates through the trunk (not frozen, not warming up)."""
        return not self.hparams.freeze_trunk and self.global_step >= self.hparams.heads_only_steps

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        first = batch_idx % hp.accumulate == 0
        last = (batch_idx + 1) % hp.accumulate == 0
        if first:
            self._step_started = time.perf_counter()
        # Under FSDP, one reduce-scatter per parameter per step, in the last micro-batch. The
        # headwise deferral waits for the trunk's backward: without one (frozen trunk, heads-only
        # warm-up) every unit syncs in each of its backwards, FSDP's plain rule.
        headwise = hp.loss_mode != "naive" and self._trains_trunk()
        with gradient_sync(self.model, sync=last, headwise=headwise):
            out = self._loss(batch["tokens"], train=True, index=batch.get("index"))
        loss = out.loss * hp.accumulate  # undo the 1/accumulate weighting for the log
        self._check_finite("loss", loss, out)
        # The whole batch's losses and accuracies, not rank 0's share: one all-reduce over ranks.
        n = self.config.n_future
        loss, *per_head = self.trainer.strategy.reduce(
            torch.stack([loss, *out.head_losses, *out.head_accuracy, *_exit_metrics(out)]),
            reduce_op="mean")
        self.log("train/loss", loss, prog_bar=True)
        for i in range(n):
            self.log(f"train/loss_head{i}", per_head[i])
            self.log(f"train/acc_head{i}", per_head[n + i])
        if out.exit_loss is not None:
            self.log("train/loss_exit", per_head[2 * n])
            self.log("train/acc_exit", per_head[2 * n + 1])
        if not last:
            return

        if hp.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), hp.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self._check_finite("gradient norm", norm, out)
            self.log("train/grad_norm", norm)
        lrs = dict(zip((group["name"] for group in optimizer.param_groups),
                       scheduler.get_last_lr()))
        self.log("train/lr", lrs.get("heads", lrs.get("base")), prog_bar=True)
        if hp.trunk_lr_mult != 1.0 or hp.heads_only_steps:
            self.log("train/lr_trunk", lrs["base"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._update_schedule_clock()
        scheduler.step()

        seconds = time.perf_counter() - (self._step_started or time.perf_counter())
        tokens = hp.accumulate * batch["tokens"].shape[0] * hp.seq_len * self.trainer.world_size
        rate = tokens / max(seconds, 1e-9)
        self.log("train/tokens_per_sec", rate, prog_bar=True)
        if hp.peak_flops:
            peak = hp.peak_flops * self.trainer.world_size
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

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self._loss(batch["tokens"], train=False)
        size = batch["tokens"].shape[0]
        self.log("val/loss", out.loss, prog_bar=True, sync_dist=True, batch_size=size)
        for i, (head_loss, accuracy) in enumerate(zip(out.head_losses, out.head_accuracy)):
            self.log(f"val/loss_head{i}", head_loss, sync_dist=True, batch_size=size)
            self.log(f"val/acc_head{i}", accuracy, sync_dist=True, batch_size=size)
        if out.exit_loss is not None:
            exit_loss, exit_accuracy = _exit_metrics(out)
            self.log("val/loss_exit", exit_loss, sync_dist=True, batch_size=size)
            self.log("val/acc_exit", exit_accuracy, sync_dist=True, batch_size=size)

    # -- checkpoints ------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokenizer_files"] = self.tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokenizer_files = checkpoint.get("tokenizer_files", self.tokenizer_files)


def _exit_metrics(out: LossOutput) -> list[torch.Tensor]:
    """The early exit's loss and top-1 accuracy, or nothing without an early exit."""
    if out.exit_loss is None:
        return []
    return [out.exit_loss, out.exit_correct / out.head_count[0].clamp(min=1)]
