"""The defects a first try hit (issue 26; a quiet first training run): each fails on the main
it was found on."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mtp.checkpoint import WEIGHTS_FILE, export, load
from mtp.eval.runner import EvalConfig
from mtp.generate.__main__ import main as generate_main
from mtp.generate.measure import measure_decoding
from mtp.model import MTPModel
from mtp.paths import REPO_ROOT
from mtp.tokenizers import ByteTokenizer


def test_sequential_heads_are_measured_after_training(tiny_config) -> None:
    # The end-of-training decoding resolves the heads' drafter as generate does: sequential
    # modules draft with SequentialDrafter (HeadsDrafter refuses them).
    model = MTPModel(dataclasses.replace(tiny_config, head_type="sequential")).eval()
    figures = measure_decoding(model, ByteTokenizer(), ["def f(x):", "import os\n"],
                               max_new_tokens=6, trees=["tree8"])
    assert set(figures["tokens_per_forward"]) == {1, 2, 3, 4} and figures["identical"]
    assert figures["tree"] == "tree8"


def test_a_tied_config_with_its_own_output_weight_is_refused(tiny_config, tmp_path) -> None:
    tied = dataclasses.replace(tiny_config, tie_embeddings=True)
    directory = export(MTPModel(tied), ByteTokenizer(), tmp_path / "export")
    load(directory)  # a real tied export stores no output.weight
    weights = directory / WEIGHTS_FILE
    state = load_file(str(weights))
    state["output.weight"] = state["tok_embeddings.weight"] + 1
    save_file(state, str(weights))
    with pytest.raises(ValueError) as error:
        load(directory)
    message = str(error.value)
    assert "\n" not in message and len(message) < 300
    assert "tie_embeddings: true" in message and "output.weight" in message

    state["output.weight"] = state["tok_embeddings.weight"].clone()  # an equal copy: harmless
    save_file(state, str(weights))
    load(directory)


def test_the_missing_checkpoint_error_is_one_short_line(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as error:
        load(tmp_path / "nowhere")
    assert str(error.value) == f"no checkpoint at {tmp_path / 'nowhere'} (neither a file nor a directory)"
    result = subprocess.run([sys.executable, "-m", "mtp.generate",
                             f"checkpoint={tmp_path / 'nowhere'}", "prompt=x"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert len(result.stderr) < 200, result.stderr


@pytest.mark.parametrize(("argument", "message"), [
    ("max_new_tokens=-5", "max_new_tokens=-5 must be a positive integer"),
    ("temperature=-1", "temperature must be a finite number >= 0, got -1"),
    ("top_p=2", "top_p must be in \\(0, 1\\], got 2"),
    ("threads=0", "threads=0 must be a positive integer or auto"),
    ("stop=['']", "stop strings must be non-empty"),
])
def test_generate_refuses_bad_arguments_before_loading(argument: str, message: str,
                                                       tmp_path: Path, capsys) -> None:
    # The checkpoint does not exist: an argument error that came after loading would be the
    # missing checkpoint's instead, and the prompt would be echoed first.
    with pytest.raises(ValueError, match=message):
        generate_main([f"checkpoint={tmp_path / 'nowhere'}", "prompt=hello", argument])
    assert capsys.readouterr().out == ""


def test_eval_refuses_bad_arguments_before_loading(tmp_path: Path) -> None:
    for bad, message in ((dict(max_new_tokens=-5), "max_new_tokens=-5 must be a positive integer"),
                         (dict(threads=0), "threads=0 must be a positive integer or auto")):
        with pytest.raises(ValueError, match=message):
            EvalConfig(task="humaneval", output=str(tmp_path / "r.jsonl"),
                       checkpoint=str(tmp_path / "nowhere"), **bad)


# Third-party lines the first training command printed before (issue: a quiet first run):
# Lightning's litlogger tip, wandb's console lines (its anonymous-setting warning among them),
# torch's LeafSpec deprecation that Lightning's code triggers, Lightning's remark that its
# model summary cannot size bf16 weights.
THIRD_PARTY = ("💡", "litlogger", "wandb", "anonymous", "LeafSpec", "deprecated", "Deprecation",
               "FutureWarning", "UserWarning", "is not supported by the model summary")


def test_the_first_training_command_prints_its_own_lines_only(tmp_path: Path) -> None:
    """The README's command, shortened (a tiny model, 4 steps, a small corpus), with its
    defaults otherwise (the wandb logger, offline; the progress bar; the model summary; the
    thread count measured afresh): no third-party advertisement or warning, and the thread
    choice on a line of its own."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted((REPO_ROOT / "mtp" / "train").glob("*.py"))[:8]:
        shutil.copy(path, corpus / path.name)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "PYTHONWARNINGS", "OMP_NUM_THREADS"))}
    env["MTP_CACHE"] = str(tmp_path / "cache")  # nothing measured yet, as on a first run
    done = subprocess.run(
        [sys.executable, "-m", "mtp.train", "+experiment=byte8", "model=tiny", "data=local",
         f"data.source.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'data'}",
         "data.val_fraction=0.3", "data.batch_size=2", "seq_len=32", "trainer.max_steps=4",
         "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "decode.enabled=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    for line in printed.splitlines():
        assert not any(word in line for word in THIRD_PARTY), line
    threads = [line for line in done.stderr.splitlines() if "threads: " in line]
    assert len(threads) == 1 and threads[0].startswith("threads: "), done.stderr
    assert "(measured in " in threads[0]
    assert "head  predicts  val loss  val acc" in done.stdout
    assert (tmp_path / "run" / "wandb").is_dir()  # the run is still logged, offline
