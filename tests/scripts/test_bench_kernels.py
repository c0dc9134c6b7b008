"""scripts/bench_kernels.py runs its smoke configuration (the smoke suite's `kernels` part):
tables, then one JSON line whose rows hang together, with the kernels and without them
(MTP_KERNELS=off: their rows skipped, with the reason)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script, prompt_file, tiny_export  # tests/ is on the path

from mtp.bench import tables
from mtp.bench.suites import KERNELS_SMOKE
from mtp.decode.drafters.registry import entry_spec

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"
ROWS = ["torch float32", "torch bfloat16", "kernels float32", "kernels bfloat16"]


def run(tmp_path: Path, *args: str, **env: str) -> tuple[str, dict]:
    """The script with `args` (none: the smoke configuration): its tables and its JSON."""
    done = subprocess.run([sys.executable, str(SCRIPT), *(args or KERNELS_SMOKE)], cwd=tmp_path,
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    *printed, last = done.stdout.strip().splitlines()
    return "\n".join(printed), json.loads(last)


def check(figures: dict, measured: list[str]) -> None:
    assert figures["parts"] == ["bandwidth", "matrices", "step"] and figures["smollm2"] is None
    for key in ("cpu_flags", "threads", "load", "kernels", "skipped", "seconds"):
        assert key in figures
    assert figures["bandwidth"]["gb_per_s"] > 0
    matrices, step = figures["matrices"], figures["step"]
    assert matrices["count"] == 3 * 7 + 1  # tiny: 2 trunk blocks and head 0, the unembedding
    assert list(matrices["rows"]) == measured and list(step["rows"]) == measured
    for row in matrices["rows"].values():
        assert list(row["ms"]) == ["1", "8"] and min(row["ms"].values()) > 0
        assert row["m1_over_floor"] > 0 and row["floor_ms"] > 0 and row["load"]
    for name, row in step["rows"].items():
        assert row["ms"]["1"] > 0 and row["matrices_ms"]["1"] == matrices["rows"][name]["ms"]["1"]
        assert row["over_matrices"]["8"] == pytest.approx(
            row["ms"]["8"] / row["matrices_ms"]["8"], rel=0.01)
    skipped = [row for row in ROWS if row not in measured]
    assert sorted(figures["skipped"]) == sorted(
        f"{part} {row}" for part in ("matrices", "step") for row in skipped)


def test_bench_kernels_smoke(tmp_path: Path) -> None:
    printed, figures = run(tmp_path)
    kernels = figures["kernels"]["available"] and figures["kernels"]["active"]
    check(figures, ROWS if kernels else ROWS[:2])
    assert tables.kernels(figures) == printed  # the table docs/benchmarks.md shows
    assert "| torch bfloat16 |" in printed and "| arithmetic | MB | M=1 | M=8 |" in printed


def test_bench_kernels_without_the_kernels(tmp_path: Path) -> None:
    printed, figures = run(tmp_path, MTP_KERNELS="off")
    check(figures, ROWS[:2])
    assert figures["kernels"]["active"] is False
    assert set(figures["skipped"].values()) == {figures["kernels"]["reason"]}
    assert "MTP_KERNELS=off" in printed and "| kernels float32 |" not in printed


def test_bench_kernels_arguments() -> None:
    parse = load_script("bench_kernels").parse_args
    args = parse(["parts=[step]", "drafters=[\"heads k=4\",prompt_lookup]", "num_draft=4"])
    spec = entry_spec("prompt_lookup", args.options, "drafters")
    assert args.parts == ["step"] and spec.options["num_draft"] == 4
    for bad, match in (("parts=[gpu]", "parts="), ("scale=huge", "scale="), ("ms=[0]", "ms="),
                       ("widths=[]", "widths="),
                       ("drafter_dtypes=[float16]", "drafter_dtypes")):
        with pytest.raises(ValueError, match=match):
            parse([bad])


def test_bench_kernels_steps_of_an_export_by_width(tmp_path: Path) -> None:
    """The step part alone at the widths asked (the studies' dtypes by width): no bare matrices
    were timed, so the table has no columns for them, nor step(8) / step(1) without 8."""
    directory = tiny_export(tmp_path)
    printed, figures = run(tmp_path, "parts=[step]", f"checkpoint={directory}", "widths=[1,2,4]",
                           "context=8", "repeats=2", "threads=1")
    step = figures["step"]
    assert step["widths"] == [1, 2, 4] and step["checkpoint"] == str(directory)
    assert {"torch float32", "torch bfloat16"} <= set(step["rows"])
    for row in step["rows"].values():
        assert list(row["ms"]) == ["1", "2", "4"] and min(row["ms"].values()) > 0
        assert row["step8_over_step1"] is None
    assert "| arithmetic | step(1) ms | step(2) ms | step(4) ms |\n" in printed


def test_bench_kernels_end_to_end_on_a_tiny_export(tmp_path: Path) -> None:
    """The smollm2 part's rows, on a tiny random export in place of SmolLM2's GGUF."""
    directory, prompts = tiny_export(tmp_path), prompt_file(tmp_path)
    _, figures = run(tmp_path, "parts=[smollm2]", f"checkpoint={directory}", "humaneval_select=[]",
                     f"prompt_file={prompts}", "max_new_tokens=6", "threads=1",
                     'drafters=[prompt_lookup,"heads k=3"]', "drafter_dtypes=[float32,bfloat16]")
    e2e = figures["smollm2"]
    on = figures["kernels"]["active"]
    paths = ["torch", "kernels"] if on else ["torch"]
    drafted = "kernels" if on else "torch"
    assert list(e2e["rows"]) == [f"{d} {p} autoregressive" for p in paths
                                 for d in ("float32", "bfloat16")] + [
        f"{d} {drafted} {m} exact" for d in ("float32", "bfloat16")
        for m in ("prompt_lookup", "heads k=3")]
    assert e2e["prompts"] == 2 and e2e["rows"]["float32 torch autoregressive"]["speedup"] == 1
    for row in e2e["rows"].values():
        assert row["tokens_per_second"] > 0 and 0 <= row["identical"] <= 1
        assert row["tokens_per_forward"] >= 1 and 0 <= row["repeated"] <= 1
    if on:  # exact mode on the kernels: the kernels' autoregressive ids, bit for bit
        assert all(row["identical"] == 1 for name, row in e2e["rows"].items()
                   if "exact" in name or "kernels" in name)
    assert "| float32 torch autoregressive |" in tables.kernels(figures)
