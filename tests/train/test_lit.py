"""The LightningModule on hand-made batches: it learns, accumulates, and stops on NaN."""

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import mtp
from mtp.checkpoint import tokenizer_files
from mtp.model import MTPConfig
from mtp.tokenizers import ByteTokenizer
from mtp.train.lit import MTPLitModule, NonFiniteLossError
from mtp.train.settings import LossSettings, OptimSettings, RunSettings, TrainSettings

SEQ_LEN = 32
CURVE = Path(__file__).parents[1] / "fixtures" / "tiny_loss_curve.json"


def _blocks(n_future: int) -> list[dict[str, torch.Tensor]]:
    """Overlapping blocks of a repetitive byte stream, as the data pipeline cuts them."""
    stream = torch.tensor(list(b"def add(a, b):\n    return a + b\n\n" * 120))
    width = SEQ_LEN + n_future
    return [{"tokens": stream[i:i + width]} for i in range(0, len(stream) - width, SEQ_LEN)]


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.losses.append(trainer.callback_metrics["train/loss"].item())


class _Gradients(Callback):
    """The gradients an optimizer step is about to apply (after clipping, if any)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, lit: MTPLitModule,
                                 *args: object) -> None:
        self.grads = {name: p.grad.clone() for name, p in lit.model.named_parameters()}


def _settings(max_steps: int, *, loss: LossSettings | None = None, compile: bool = False,
              **optim: object) -> TrainSettings:
    """The settings of these tests' runs: SEQ_LEN, lr 1e-2 and a 2-step warm-up unless said."""
    return TrainSettings(run=RunSettings(seq_len=SEQ_LEN, max_steps=max_steps, compile=compile),
                         loss=loss or LossSettings(),
                         optim=OptimSettings(**{"lr": 1e-2, "warmup_steps": 2, **optim}))


def _trainer(steps: int, **kwargs: object) -> L.Trainer:
    """A quiet CPU trainer of `steps` optimizer steps (`kwargs`: the test's own options)."""
    return L.Trainer(**{"max_steps": steps, "accelerator": "cpu", "logger": False,
                        "enable_checkpointing": False, "enable_progress_bar": False,
                        "enable_model_summary": False, **kwargs})


def _fit(config: MTPConfig, steps: int, *, batch_size: int = 4,
         callbacks: list[Callback] = (), precision: str = "32-true", **settings: object
         ) -> tuple[MTPLitModule, list[float]]:
    L.seed_everything(0, verbose=False)
    lit = MTPLitModule(config, _settings(steps, **settings))
    losses = _Losses()
    trainer = _trainer(steps, callbacks=[losses, *callbacks], precision=precision)
    loader = DataLoader(_blocks(lit.settings.loss.lookahead(config.n_future)),
                        batch_size=batch_size, shuffle=False)
    trainer.fit(lit, loader)
    return lit, losses.losses


class _Recorded(Callback):
    """The logged value of each of `names` after every training batch."""

    def __init__(self, *names: str) -> None:
        self.values: dict[str, list[float]] = {name: [] for name in names}

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        for name, values in self.values.items():
            values.append(trainer.callback_metrics[name].item())


def test_a_few_steps_lower_every_heads_loss(tiny_config: MTPConfig) -> None:
    lit, losses = _fit(tiny_config, 30)
    assert len(losses) == 30
    assert losses[-1] < 0.7 * losses[0]
    with torch.no_grad():
        out = lit._loss(torch.stack([b["tokens"] for b in _blocks(4)[:8]]), train=False)
    assert (out.head_losses < 3.0).all()  # every head learned, not just the first


def _check_curve(losses: list[float], path: Path) -> None:
    """Compare with the stored curve; MTP_WRITE_CURVE=1 (re)writes it, nothing else does."""
    if os.environ.get("MTP_WRITE_CURVE"):
        path.write_text(json.dumps({"steps": len(losses), "losses": losses}, indent=1) + "\n")
    if not path.exists():
        pytest.fail(f"the reference loss curve {path} is missing; if that is intended, "
                    f"regenerate it: MTP_WRITE_CURVE=1 pytest tests/train/test_lit.py")
    stored = json.loads(path.read_text())["losses"]
    assert losses == pytest.approx(stored, rel=1e-3)


def test_loss_curve_matches_the_stored_one(tiny_config: MTPConfig) -> None:
    """Catches silent numerics changes. Regenerate: MTP_WRITE_CURVE=1 pytest tests/train/test_lit.py"""
    _, losses = _fit(tiny_config, 10)
    _check_curve(losses, CURVE)


def test_accumulation_gives_the_larger_batchs_gradients(tiny_config: MTPConfig) -> None:
    """Gradients, not weights after AdamW (which would hide a wrong 1/accumulate scale); no
    clipping, which would too."""
    big, accumulated = _Gradients(), _Gradients()
    _fit(tiny_config, 1, batch_size=8, grad_clip=0.0, callbacks=[big])
    _fit(tiny_config, 1, batch_size=4, accumulate=2, grad_clip=0.0, callbacks=[accumulated])
    assert big.grads.keys() == accumulated.grads.keys()
    for name, grad in big.grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(accumulated.grads[name], grad, rtol=1e-4, atol=1e-7,
                                   msg=name)


def test_a_bf16_mixed_step_runs_under_autocast(tiny_config: MTPConfig) -> None:
    dtypes = []

    class Dtypes(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, lit: MTPLitModule,
                                 *args: object) -> None:
            if not dtypes:
                lit.model.output.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))

    lit, losses = _fit(tiny_config, 8, precision="bf16-mixed", callbacks=[Dtypes()])
    _, exact = _fit(tiny_config, 1)
    assert set(dtypes) == {torch.bfloat16}  # the unembedding ran in bf16
    assert all(p.dtype == torch.float32 for p in lit.model.parameters())  # master weights
    assert losses[0] == pytest.approx(exact[0], rel=2e-2) and losses[0] != exact[0]
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.9 * losses[0]


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones(tiny_config: MTPConfig) -> None:
    config = replace(tiny_config, n_layers=1, n_future=2)  # fewer blocks: a quicker compile
    compiled, compiled_losses = _fit(config, 3, compile=True)
    _, eager_losses = _fit(config, 3)
    assert all(hasattr(block, "_compiled_call_impl") for block in compiled.model.layers)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)


@pytest.mark.parametrize("mode", ["naive", "chunked"])
def test_loss_modes_train_alike(tiny_config: MTPConfig, mode: str) -> None:
    headwise, _ = _fit(tiny_config, 2)
    other, _ = _fit(tiny_config, 2, loss=LossSettings(mode=mode))
    for a, b in zip(headwise.model.parameters(), other.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_non_finite_loss_stops_the_run(tiny_config: MTPConfig) -> None:
    class Poison(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, lit: MTPLitModule, batch: object,
                                 batch_idx: int) -> None:
            if batch_idx == 3:
                with torch.no_grad():
                    lit.model.output.weight.fill_(float("nan"))

    lit = MTPLitModule(tiny_config, _settings(10, lr=3e-3, warmup_steps=1))
    trainer = _trainer(10, callbacks=[Poison()])
    with pytest.raises(NonFiniteLossError, match="non-finite loss .* at step 3"):
        trainer.fit(lit, DataLoader(_blocks(4), batch_size=4))
    assert trainer.global_step == 3  # the bad step was never applied


def test_a_scheduled_run_trains_and_logs_the_weights_of_each_step(
        tiny_config: MTPConfig) -> None:
    """The forward curriculum over 6 steps, 3 distances: head 1 rises over steps 0-2, head 2
    over 2-4, head 3 over 4-6; step 0 trains head 0 alone."""
    names = [f"train/loss_weight_head{i}" for i in (1, 2, 3)]
    recorded, gradients = _Recorded(*names), _Gradients()
    _fit(tiny_config, 1, callbacks=[gradients], loss=LossSettings(schedule="ramp"))
    assert all(gradients.grads[f"heads.{i}.0.feed_forward.w2.weight"].abs().sum() == 0
               for i in (1, 2, 3))
    assert gradients.grads["heads.0.0.feed_forward.w2.weight"].abs().sum() > 0
    _fit(tiny_config, 6, callbacks=[recorded], loss=LossSettings(schedule="ramp"))
    logged = list(zip(*(recorded.values[name] for name in names)))
    assert logged == [pytest.approx(w, abs=1e-6) for w in [
        (0, 0, 0), (0.5, 0, 0), (1, 0, 0), (1, 0.5, 0), (1, 1, 0), (1, 1, 0.5)]]


def test_the_look_ahead_term_trains_one_head_on_longer_blocks(tiny_config: MTPConfig) -> None:
    """loss.ahead on a one-head model: blocks of seq_len + 3 tokens, the look-ahead losses and
    their annealed weights logged (t+3's falls over steps 0-2, then t+2's over 2-4)."""
    one_head = MTPConfig(**{**tiny_config.to_dict(), "n_future": 1})
    names = ["train/loss_weight_ahead1", "train/loss_weight_ahead2", "train/loss_ahead1",
             "train/acc_ahead2", "train/loss_head0", "train/loss"]
    recorded = _Recorded(*names)
    lit, _ = _fit(one_head, 4, callbacks=[recorded],
                  loss=LossSettings(ahead=[0.5, 0.25], schedule="anneal"))
    values = recorded.values
    assert values["train/loss_weight_ahead1"] == pytest.approx([0.5, 0.5, 0.5, 0.25])
    assert values["train/loss_weight_ahead2"] == pytest.approx([0.25, 0.125, 0, 0])
    assert all(0 <= a <= 1 for a in values["train/acc_ahead2"])
    with pytest.raises(ValueError, match=r"expected \(batch, seq_len \+ look-ahead = 32 \+ 3"):
        lit._loss(torch.zeros(2, 33, dtype=torch.long), train=False)


def test_bad_settings_are_named(tiny_config: MTPConfig) -> None:
    run = RunSettings(seq_len=128, max_steps=10)
    with pytest.raises(ValueError, match=r"seq_len=128 .*max_seq_len=64"):
        MTPLitModule(tiny_config, TrainSettings(run=run))
    with pytest.raises(ValueError, match=r"loss.weights=\[1.0\] .*n_future=4"):
        MTPLitModule(tiny_config, _settings(10, loss=LossSettings(weights=[1.0])))
    with pytest.raises(ValueError, match=r"loss.early_exit=2 must be a trunk layer from 1 to "
                                         r"n_layers - 1 = 1"):
        MTPLitModule(tiny_config, _settings(10, loss=LossSettings(early_exit=2)))
    lit = MTPLitModule(tiny_config, _settings(10))
    lit.configure_model()
    short = torch.zeros(2, 34, dtype=torch.long)  # 2 spare tokens for 4 heads
    with pytest.raises(ValueError, match=r"shape \(2, 34\).*32 \+ 4 = 36"):
        lit._loss(short, train=False)


class _SlowAndRecorded(Callback):
    """A slow machine (the time budget, not the steps, sets the pace); records the LR."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        time.sleep(0.3)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.lrs.append(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])


def _fit_slowly(config: MTPConfig, steps: int, seconds: int, ckpt_path: Path | None = None
                ) -> tuple[L.Trainer, list[float]]:
    L.seed_everything(0, verbose=False)
    lit = MTPLitModule(config, _settings(10_000, warmup_steps=1))  # steps alone barely decay
    recorded = _SlowAndRecorded()
    trainer = _trainer(steps, max_time={"seconds": seconds}, callbacks=[recorded])
    trainer.fit(lit, DataLoader(_blocks(4), batch_size=4), ckpt_path=ckpt_path)
    return trainer, recorded.lrs


@pytest.mark.slow
def test_a_resumed_run_continues_the_time_budgeted_schedule(tiny_config: MTPConfig,
                                                            tmp_path: Path) -> None:
    """The schedule's clock is Lightning's Timer, which checkpoints restore: a run resumed
    part-way into its time budget continues the decay instead of restarting it."""
    first, first_lrs = _fit_slowly(tiny_config, 5, 20)
    first.save_checkpoint(tmp_path / "part.ckpt")
    _, resumed_lrs = _fit_slowly(tiny_config, 8, 20, tmp_path / "part.ckpt")
    assert len(first_lrs) == 5 and len(resumed_lrs) == 3
    assert first_lrs[-1] < 0.995 * 1e-2  # part of the time budget is spent: decaying
    lrs = first_lrs + resumed_lrs
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), lrs  # no restart after resuming


def test_resuming_a_run_its_time_guard_stopped_ends_at_once(tiny_config: MTPConfig,
                                                            tmp_path: Path) -> None:
    stopped, _ = _fit_slowly(tiny_config, 1000, 1)
    assert 0 < stopped.global_step < 1000
    stopped.save_checkpoint(tmp_path / "spent.ckpt")
    resumed, lrs = _fit_slowly(tiny_config, 1000, 1, tmp_path / "spent.ckpt")
    assert resumed.global_step == stopped.global_step and lrs == []  # the budget is spent


def test_checkpoints_hold_plain_settings_that_load_back(tiny_config: MTPConfig,
                                                        tmp_path: Path) -> None:
    """Lightning resumes and `mtp.load` reads a checkpoint with weights_only=True: the
    hyperparameters are plain values, from which `load_from_checkpoint` rebuilds the same
    config and settings."""
    settings = _settings(1, loss=LossSettings(weights=[1, 0.5, 0.5, 0.5]), trunk_lr_mult=0.5)
    lit = MTPLitModule(tiny_config, settings, tokenizer_files=tokenizer_files(ByteTokenizer()))
    trainer = _trainer(1)
    trainer.fit(lit, DataLoader(_blocks(4), batch_size=4))
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    stored = torch.load(tmp_path / "one.ckpt", weights_only=True)["hyper_parameters"]
    assert stored == {"model": tiny_config.to_dict(), "settings": settings.to_dict()}
    restored = MTPLitModule.load_from_checkpoint(tmp_path / "one.ckpt")
    assert (restored.config, restored.settings) == (tiny_config, settings)
    model, _ = mtp.load(tmp_path / "one.ckpt")
    assert model.config == tiny_config
