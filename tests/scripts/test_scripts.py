"""Every script in scripts/ runs end to end at smoke size (tiny random checkpoints, a few
tokens): a table, then one JSON line whose figures hang together. Scripts import the
installed `mtp` package only: each runs as `python scripts/NAME.py` from outside the checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script  # tests/ is on the path

from mtp.bench.suites import suite
from mtp.bench.tiny import tiny_checkpoint, tiny_prompts

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
# the tests of scripts that have their own test file
TESTED_ELSEWHERE = {"bench_decode": "scripts/test_bench_decode.py",
                    "bench_methods": "scripts/test_bench_methods.py",
                    "bench_train": "scripts/test_bench_train.py",
                    "prepare_data": "scripts/test_prepare_data.py",
                    "distill_data": "scripts/test_distill_data.py",
                    "eval_hf": "scripts/test_eval_hf.py",
                    "paper_small": "scripts/test_paper_small.py",
                    "bench_threads": "scripts/test_bench_threads.py",
                    "bench_exact": "scripts/test_bench_exact.py",
                    "bench_kernels": "scripts/test_bench_kernels.py",
                    "bench_acceptance": "scripts/test_bench_acceptance.py",
                    "better_study": "scripts/test_better_study.py",
                    "bench_engines": "scripts/test_bench_engines.py"}


def run_script(name: str, *args: str, cwd: Path) -> tuple[list[str], dict]:
    """Run scripts/NAME.py with `mtp` importable as an installed package would be (not from
    the script's folder); its table lines and its last-line JSON."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    *table, last = done.stdout.strip().splitlines()
    return table, json.loads(last)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random byte checkpoint (4 heads) and a prompt file that fits its context."""
    root = tmp_path_factory.mktemp("tiny")
    return tiny_checkpoint(root / "export"), tiny_prompts(root / "prompts.jsonl")


def test_every_script_is_run_by_a_test() -> None:
    """Here, in its own test file, or in the smoke suite (tests/bench/test_suites.py runs it)."""
    here = Path(__file__).read_text()
    smoke = " ".join(" ".join(part.command) for part in suite("smoke"))
    for script in sorted(SCRIPTS.glob("*.py")):
        name = script.stem
        if f"scripts/{name}.py" in smoke:
            continue
        if name in TESTED_ELSEWHERE:
            text = (REPO / "tests" / TESTED_ELSEWHERE[name]).read_text()
            assert f'"{name}.py"' in text or f'load_script("{name}")' in text, name
        else:
            assert f'run_script("{name}"' in here, f"scripts/{name}.py is run by no test"


def test_no_script_edits_sys_path_or_imports_another() -> None:
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    for script in SCRIPTS.glob("*.py"):
        text = script.read_text()
        assert "sys.path" not in text, script.name
        for name in names:
            assert f"from {name} import" not in text and f"import {name}\n" not in text, script.name


def test_bench_hf(tiny, tmp_path) -> None:
    pytest.importorskip("transformers")
    checkpoint, prompts = tiny
    _, out = run_script("bench_hf", f"checkpoint={checkpoint}", f"prompts={prompts}",
                        "max_new_tokens=4", "repeats=1", "static=false", "threads=1", "device=cpu",
                        cwd=tmp_path)
    # the same weights and input ids through both libraries: the same greedy ids
    assert out["identical"] and out["hf_static_tokens_per_second"] is None
    assert set(out["per_method_tokens_per_second"]) == {
        "hf", "hf_prompt_lookup", "mtp_k1", "mtp_k2", "mtp_k3", "mtp_k4"}
    assert out["new_tokens"] == 3 * 4 and out["prompts"] == 3
    assert out["mtp_spec_tokens_per_forward"] >= 1.0


def test_bench_online(tiny, tmp_path) -> None:
    checkpoint, prompts = tiny
    table, out = run_script("bench_online", f"checkpoint={checkpoint}", f"prompts={prompts}",
                            "max_new_tokens=6", "k=3", "window=1", "lr=1e-3", cwd=tmp_path)
    assert out["identical"] and out["prompts"] == 3 and len(table) == 2 + 2
    for arm in ("frozen", "online"):
        assert 1.0 <= out[arm]["tokens_per_forward"] <= 3.0
    assert out["frozen"]["optimizer_steps"] == 0 and out["online"]["optimizer_steps"] == 2


@pytest.mark.slow
def test_bench_heads_cost_only(tmp_path) -> None:
    table, out = run_script("bench_heads", f"out={tmp_path / 'heads'}", "cost_only=true",
                            "n_future=[2]", "time_steps=1", "batch=2", "seq_len=16", "threads=1",
                            "model=tiny", cwd=tmp_path)
    assert set(out["runs"]) == {"block n=2", "sequential n=2"}
    assert all(r["step_bytes"] > 0 and r["step_seconds"] > 0 for r in out["runs"].values())
    assert (out["batch"], out["seq_len"]) == (2, 16)
    assert json.loads((tmp_path / "heads" / "results.json").read_text())["runs"] == out["runs"]


def test_bench_heads_decodes_a_run_with_the_shared_harness(tiny, tmp_path) -> None:
    """The decoding half of bench_heads (its training half is mtp.train's, tested there)."""
    bench_heads = load_script("bench_heads")
    checkpoint, _ = tiny
    figures = bench_heads.tokens_per_forward(checkpoint.parent, ["def f(x):", "import os"],
                                             "tree8", 4)
    assert figures["prompts"] == 2
    for key in ("chain", "tree", "chain_t08", "tree_t08"):
        assert figures[f"tokens_per_forward_{key}"] >= 1.0
        assert 0.0 <= figures[f"repeated_{key}"] <= 1.0


def test_bench_fsdp_comms(tmp_path) -> None:
    _, out = run_script("bench_fsdp_comms", "vocab_size=262", "dim=32", "n_layers=1",
                        "n_heads=4", "n_future=2", "seq_len=8", cwd=tmp_path)
    assert out["world_size"] == 2 and out["fsdp_units"] == 1 + 2 + 2
    gathers = [value for key, value in out.items() if key.endswith("_all_gathers")]
    assert gathers and all(value > 0 for value in gathers)


def test_bench_sandbox(tmp_path) -> None:
    table, out = run_script("bench_sandbox", "rounds=1", "problems=3", "levels=[none]",
                            "workers=1", cwd=tmp_path)
    [row] = out["results"]
    assert (row["task"], row["programs"], row["isolation"]) == ("humaneval", 3, "none")
    assert row["seconds"] > 0


def test_check_gguf(tmp_path) -> None:
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    transformers = pytest.importorskip("transformers")
    from gguf_files import byte_level_vocab, write_gguf  # tests/ is on the path

    from mtp.tokenizers import BPETokenizer

    tokenizer = BPETokenizer.train(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_theta=1000.0, rms_norm_eps=1e-5)
    path = write_gguf(tmp_path / "tiny.gguf", transformers.LlamaForCausalLM(config).eval(),
                      byte_level_vocab(tokenizer))
    _, out = run_script("check_gguf", f"gguf={path}", "prompts=1", "max_new_tokens=3",
                        "threads=1", cwd=tmp_path)
    assert out["prompts"] == 1 and out["ids_equal_transformers"] == 1
    assert out["max_abs_logit_diff"] < 1e-3 and out["greedy_identical"] == 1


def test_bench_layer_skip(tiny, tmp_path) -> None:
    """The search's choice, then the sweep: every row identical to autoregressive decoding."""
    checkpoint, prompts = tiny
    choice = tmp_path / "layer_skip.json"
    done = subprocess.run([sys.executable, "-m", "mtp.generate.skip_search",
                           f"checkpoint={checkpoint}", f"prompt_file={prompts}", "prompts=2",
                           "max_new_tokens=8", f"output={choice}"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    table, out = run_script("bench_layer_skip", f"checkpoint={checkpoint}", f"choice={choice}",
                            "skipped=[1]", 'prompt=["def f(x):","import os"]',
                            "max_new_tokens=6", cwd=tmp_path)
    rows = out["rows"]
    assert list(rows)[0] == "autoregressive" and len(rows) == 3  # 1 skipped, the choice
    assert all(row["identical"] for row in rows.values())
    assert rows["skip 1 of 2"]["draft_share"] < 1 and len(rows["skip 1 of 2"]["skipped"]) == 1
    assert any(line.startswith("skip 1 of 2") for line in table)
    # without choice=: the search's choice the tuner kept for this checkpoint
    _, again = run_script("bench_layer_skip", f"checkpoint={checkpoint}", "skipped=[1]",
                          'prompt=["def f(x):","import os"]', "max_new_tokens=6", cwd=tmp_path)
    assert list(again["rows"]) == list(rows)
