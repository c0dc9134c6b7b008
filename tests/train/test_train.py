"""`train(cfg)` end to end on a tiny model and corpus; resuming after SIGKILL; early errors."""

import argparse
import csv
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mtp
from mtp.paths import REPO_ROOT
from mtp.train.lit import MTPLitModule
from mtp.train.plots import read_metrics_csv
from mtp.train.run import check_resumable, compose, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small local corpus: this package's own source files."""
    root = tmp_path_factory.mktemp("corpus")
    for path in sorted((REPO_ROOT / "mtp").rglob("*.py")):
        shutil.copy(path, root / f"{path.parent.name}_{path.name}")
    return root


def _overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["+experiment=byte8", "model=tiny", "data=local", f"data.source.paths=[{corpus}]",
            f"data.cache_dir={corpus.parent / 'cache'}", "data.val_fraction=0.3",
            "data.batch_size=4", "seq_len=64", "logger=csv", "trainer.log_every_n_steps=1",
            "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
            "optim.warmup_steps=5", "optim.lr=1e-2", "trainer.precision=32-true",
            "decode.enabled=false", f"run_dir={run_dir}", *extra]


def _losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"])
                for row in csv.DictReader(f) if row.get("train/loss")}


def test_train_exports_a_model_that_learned(corpus: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    cfg = compose(_overrides(corpus, tmp_path, "trainer.max_steps=30",
                             "trainer.val_check_interval=15", "checkpoint.every_n_steps=15",
                             "decode.enabled=true", "decode.prompts=2",
                             "decode.max_new_tokens=8", "decode.trees=[tree8]"))
    export_dir = train(cfg)
    losses = _losses(tmp_path)
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < 0.8 * first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last.ckpt", "step0000015.ckpt", "step0000030.ckpt"]
    model, tokenizer = mtp.load(export_dir)
    assert model.config.n_future == 8 and tokenizer.vocab_size == 262
    ckpt_model, _ = mtp.load(tmp_path / "checkpoints" / "last.ckpt")
    check_resumable(str(tmp_path / "checkpoints" / "last.ckpt"))  # a checkpoint it resumes
    tokens = torch.tensor([tokenizer.encode("def f(x):")])
    torch.testing.assert_close(model(tokens), ckpt_model(tokens), rtol=0, atol=0)
    summary = capsys.readouterr().out
    assert "head  predicts  val loss  val acc" in summary and "   7  t+8" in summary
    assert str(export_dir) in summary

    # After the validation table, the export's decoding of held-out prompts, measured.
    table = summary[summary.index("head  predicts"):]
    assert re.search(r"decoding 2 HumanEval prompts x 8 new tokens \(greedy, batch 1, cpu; "
                     r"\d+% of the text repeats an earlier 8-gram\)\n   k  tok/fwd  speed-up\n"
                     r"   1     1\.00     1\.00x\n(   \d  .*\n){7}tree tree8: ", table), table
    result = json.loads((tmp_path / "summary.json").read_text())
    assert f"summary:  {tmp_path / 'summary.json'}" in summary
    assert result["steps"] == 30 and result["stopped_early"] is None
    assert result["export"] == str(export_dir) and result["parameters"] == model.num_params()
    assert len(result["val"]["loss_head"]) == len(result["val"]["acc_head"]) == 8
    decode = result["decode"]
    assert {"tokens_per_forward", "tree", "tree_tokens_per_forward", "repeated",
            "device"} <= decode.keys()
    assert list(decode["tokens_per_forward"]) == [str(k) for k in range(1, 9)]
    assert decode["tree"] == "tree8" and decode["device"] == "cpu" and decode["identical"]
    logged = read_metrics_csv(tmp_path / "logs" / "metrics.csv")
    assert [step for step, _ in logged["decode/tokens_per_forward_k8"]] == [30]


def test_a_run_shorter_than_the_validation_interval_validates_at_the_end(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`trainer.max_steps=3` under the preset's val_check_interval, with no logger at all."""
    cfg = compose(_overrides(corpus, tmp_path, "trainer.max_steps=3", "logger=none",
                             "trainer.val_check_interval=200"))
    train(cfg)
    summary = capsys.readouterr().out
    assert "   7  t+8" in summary and "stopped early" not in summary
    assert f"plots:    {tmp_path / 'plots'}" in summary
    assert "decoding" not in summary  # decode.enabled=false
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["decode"] is None and result["val"]["acc_head"][7] == pytest.approx(
        float(summary.split("   7  t+8")[1].split()[1]), abs=1e-4)
    history = read_metrics_csv(tmp_path / "plots" / "metrics.csv")
    assert [step for step, _ in history["val/acc_head7"]] == [3]
    assert [step for step, _ in history["train/loss_head0"]] == [1, 2, 3]
    assert {"loss.png", "accuracy.png", "lr.png"} <= {p.name for p in (tmp_path / "plots").iterdir()}


def test_an_early_exit_is_trained_and_logged(corpus: Path, tmp_path: Path) -> None:
    """loss.early_exit: the exit's loss and accuracy are logged beside the heads', in
    training and validation; a layer the trunk lacks is refused before training."""
    cfg = compose(_overrides(corpus, tmp_path, "trainer.max_steps=3", "model.depth=12",
                             "trainer.val_check_interval=3", "loss.early_exit=2",
                             "loss.early_exit_weight=0.5"))
    train(cfg)
    history = read_metrics_csv(tmp_path / "plots" / "metrics.csv")
    assert [step for step, _ in history["train/loss_exit"]] == [1, 2, 3]
    assert [step for step, _ in history["val/acc_exit"]] == [3]
    assert all(0 <= value <= 1 for _, value in history["train/acc_exit"])
    with pytest.raises(ValueError, match="early_exit=9 must be a trunk layer from 1 to"):
        train(compose(_overrides(corpus, tmp_path / "bad", "trainer.max_steps=1",
                                 "loss.early_exit=9")))


def test_the_heads_only_finish_leaves_head_0_bit_identical(corpus: Path, tmp_path: Path) -> None:
    """byte8_anneal, then heads_finish from its export: the first run logs and plots its
    annealed weights; the finish trains heads 1..7 alone on the cached trunk, so head 0's
    logits are bit-identical to the first run's and the heads' are not."""
    first, second = tmp_path / "anneal", tmp_path / "finish"
    train(compose(["+experiment=byte8_anneal", *_overrides(
        corpus, first, "trainer.max_steps=4", "trainer.val_check_interval=4")[1:]]))
    history = read_metrics_csv(first / "plots" / "metrics.csv")
    weights = [value for _, value in history["train/loss_weight_head7"]]
    assert weights[0] > weights[-1] == 0 and (first / "plots" / "weights.png").is_file()
    train(compose(["+experiment=heads_finish", *_overrides(
        corpus, second, f"init_from={first / 'export'}", "trainer.max_steps=3",
        "trainer.val_check_interval=3")[1:]]))
    (annealed, tokenizer), (finished, _) = mtp.load(first / "export"), mtp.load(second / "export")
    assert finished.config == annealed.config and finished.config.head_type == "resblock"
    tokens = torch.tensor([tokenizer.encode("def f(x):\n    return x + 1\n")])
    with torch.no_grad():
        before, after = annealed(tokens), finished(tokens)
    assert torch.equal(before[:, :, 0], after[:, :, 0])  # bit for bit
    assert not torch.equal(before[:, :, 1:], after[:, :, 1:])
    result = json.loads((second / "summary.json").read_text())
    assert result["steps"] == 3 and "train/loss_weight_head1" not in read_metrics_csv(
        second / "plots" / "metrics.csv")


@pytest.mark.slow
def test_a_slow_machine_decays_the_lr_by_the_time_guard(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1000-step run with a 3-second guard and an artificial delay per step (issue 13)."""
    step = MTPLitModule.training_step

    def slow_step(self: MTPLitModule, *args: object) -> None:
        time.sleep(0.05)
        step(self, *args)

    monkeypatch.setattr(MTPLitModule, "training_step", slow_step)
    cfg = compose(_overrides(corpus, tmp_path, "trainer.max_steps=1000",
                             "trainer.max_time=00:00:00:03", "trainer.val_check_interval=1000",
                             "optim.min_lr_ratio=0.1", "optim.warmup_steps=2"))
    train(cfg)
    lrs = [lr for _, lr in read_metrics_csv(tmp_path / "plots" / "metrics.csv")["train/lr"]]
    assert 1 <= len(lrs) < 1000
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decaying after the warm-up
    summary = capsys.readouterr().out
    match = re.search(r"stopped early at step (\d+) of trainer.max_steps=1000:\n"
                      r"  the trainer.max_time guard \(0:00:03\) stopped training after .*\n"
                      r"  the learning rate had come down to (\S+) \((\d+)% of its peak\)",
                      summary)
    assert match, summary
    assert int(match[1]) == len(lrs)
    # At (nearly) the floor, lr * min_lr_ratio = 1e-3: the last update of the schedule's clock
    # comes just before the guard's check; the step-only cosine would still be at ~100%.
    assert float(match[2]) < 2e-3 and int(match[3]) <= 20


def test_vocab_mismatch_fails_before_any_training(corpus: Path, tmp_path: Path) -> None:
    cfg = compose(_overrides(corpus, tmp_path, "model.vocab_size=300"))
    with pytest.raises(ValueError, match="model.vocab_size=300 does not match"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_resume_after_sigkill_continues_the_same_run(corpus: Path, tmp_path: Path) -> None:
    """Killed after a checkpoint and resumed, the run ends where an unbroken one does."""
    common = ["trainer.max_steps=40", "trainer.val_check_interval=40",
              "checkpoint.every_n_steps=10"]

    def run(name: str, *extra: str) -> subprocess.Popen:
        overrides = _overrides(corpus, tmp_path / name, *common, *extra)
        return subprocess.Popen([sys.executable, "-m", "mtp.train", *overrides],
                                cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    killed = run("killed")
    first_checkpoint = tmp_path / "killed" / "checkpoints" / "step0000010.ckpt"
    while not first_checkpoint.exists() and killed.poll() is None:
        time.sleep(0.01)
    time.sleep(0.3)  # let last.ckpt be written too
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    resumed_from = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 10 <= resumed_from < 40

    assert run("resumed", f"ckpt_path={last}").wait() == 0
    assert run("unbroken").wait() == 0
    resumed, unbroken = _losses(tmp_path / "resumed"), _losses(tmp_path / "unbroken")
    assert resumed and min(resumed) >= resumed_from  # nothing trained twice
    assert max(resumed) == max(unbroken)
    for step, loss in resumed.items():  # same batches, same weights, same optimizer state
        assert loss == pytest.approx(unbroken[step], rel=1e-4), step


@pytest.mark.slow
def test_fsdp_sharded_checkpoints_load_and_resume_on_other_rank_counts(corpus: Path,
                                                                        tmp_path: Path) -> None:
    """trainer=fsdp (ModelParallelStrategy + FSDP2) end to end on gloo ranks: a 2-rank run's
    sharded checkpoint resumes on 1 rank, that run's on 2, both continuing the unbroken run's
    losses (same global batch of 8), and mtp.load reads the sharded folder."""
    def run(name: str, ranks: int, *extra: str) -> dict[int, float]:
        overrides = _overrides(corpus, tmp_path / name, "trainer=fsdp", "trainer.accelerator=cpu",
                               "compile=false",  # the recipe compiles; here eager is the point
                               f"trainer.devices={ranks}", f"data.batch_size={8 // ranks}",
                               "trainer.max_steps=6", "trainer.val_check_interval=6",
                               "checkpoint.every_n_steps=2", "checkpoint.keep=-1", *extra)
        done = subprocess.run([sys.executable, "-m", "mtp.train", *overrides], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return _losses(tmp_path / name)

    unbroken = run("two", 2)
    two_to_one = run("two-to-one", 1, f"ckpt_path={tmp_path / 'two/checkpoints/step0000002.ckpt'}")
    one_to_two = run("one-to-two", 2,
                     f"ckpt_path={tmp_path / 'two-to-one/checkpoints/step0000004.ckpt'}")
    assert sorted(unbroken) == list(range(6))
    assert sorted(two_to_one) == [2, 3, 4, 5] and sorted(one_to_two) == [4, 5]
    for resumed in (two_to_one, one_to_two):
        for step, loss in resumed.items():
            assert loss == pytest.approx(unbroken[step], rel=1e-4), step

    last = tmp_path / "two" / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # one DCP shard per rank, not a single file
    exported, _ = mtp.load(tmp_path / "two" / "export")  # full weights gathered from both ranks
    sharded, _ = mtp.load(last)
    check_resumable(str(last))
    assert exported.config == sharded.config and exported.config.n_future == 8
    for (name, p), q in zip(exported.named_parameters(), sharded.parameters()):
        assert torch.equal(p, q), name
        assert torch.isfinite(p).all() and p.abs().sum() > 0, name


def _pickled(path: Path) -> Path:
    """A torch file holding a pickled object: a checkpoint of unknown origin."""
    torch.save({"hyper_parameters": argparse.Namespace(model={})}, path)
    return path


@pytest.mark.parametrize(("argument", "message"), [
    (lambda tmp: "optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    (lambda tmp: "loss.schedule=cosine", "loss.schedule='cosine' is not one of constant, "),
    (lambda tmp: "loss.weights=[1,1,1,1,1,1,1,2]",
     "loss.weights=[1, 1, 1, 1, 1, 1, 1, 2] must be a list of numbers in [0, 1]"),
    (lambda tmp: ["loss.schedule=anneal", "loss.schedule_steps=[0,500]"],
     "loss.schedule_steps=[0, 500] must be within the run's trainer.max_steps=400"),
    (lambda tmp: "data.source.paths=[/nonexistent/*.py]",
     "data.source.paths: /nonexistent/*.py matches no file"),
    (lambda tmp: f"ckpt_path={_pickled(tmp / 'foreign.ckpt')}",
     "foreign.ckpt is not a Lightning checkpoint: it does not load as tensors and plain values"),
], ids=["lr", "schedule", "weights", "schedule_steps", "paths", "ckpt_path"])
def test_a_bad_input_is_one_line_before_training(argument, message: str, tmp_path: Path) -> None:
    """The training command names the value in one line and exits 1, before it builds or
    reads anything else: no traceback, no run directory's checkpoints, and never torch's
    advice to unpickle a file of unknown origin with weights_only=False."""
    arguments = argument(tmp_path)
    done = subprocess.run([sys.executable, "-m", "mtp.train", "+experiment=byte8", "data=local",
                           "data.source.paths=[mtp]", "logger=none",
                           *(arguments if isinstance(arguments, list) else [arguments]),
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [f"error: {done.stderr[7:].strip()}"], done.stderr
    assert message in done.stderr and "weights_only" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_checkpoint_not_written_by_mtp_train_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nowhere.ckpt does not exist"):
        check_resumable(str(tmp_path / "nowhere.ckpt"))
    with pytest.raises(ValueError, match="is a folder but not a sharded checkpoint"):
        check_resumable(str(tmp_path))
    (tmp_path / "text.ckpt").write_text("not torch\n")
    with pytest.raises(ValueError, match="text.ckpt is not a Lightning checkpoint"):
        check_resumable(str(tmp_path / "text.ckpt"))
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="plain.ckpt is not a checkpoint that mtp.train wrote"):
        check_resumable(str(tmp_path / "plain.ckpt"))
    check_resumable(None)
