"""`python -m mtp.generate`: arguments, streaming output, statistics, clear errors."""

import json
import subprocess
import sys

import pytest
import torch

from mtp.checkpoint import export
from mtp.generate import generate
from mtp.generate.__main__ import main, parse_args
from mtp.generate.prompts import read_prompts
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer


@pytest.fixture
def checkpoint(tiny_config, tmp_path):
    model = MTPModel(tiny_config)
    return export(model, ByteTokenizer(), tmp_path / "export"), model


def test_streams_the_same_text_as_generate(checkpoint, capsys):
    directory, model = checkpoint
    main([f"checkpoint={directory}", "prompt='def fib(n):'", "max_new_tokens=12", "k=3"])
    out, err = capsys.readouterr()
    # the choices first (the tests' thread: as set)
    kernels, dtype, threads, exact, stats = err.splitlines()
    assert kernels.startswith(("kernels: on (fixed: decoding through mtp.kernels",
                               "kernels: off (fixed: decoding through torch"))
    assert dtype == "dtype: float32 (fixed: as loaded)"
    assert threads == "threads: 1 (set: torch.set_num_threads before)"
    # exact=auto: on the kernels, on without measuring
    assert exact.startswith(("exact: on (measured", "exact: off (measured", "exact: on (fixed"))
    chosen = {"exact": True, "width": 3} if exact.startswith("exact: on") else {}
    [expected] = generate(model.eval(), ByteTokenizer(), ["def fib(n):"], max_new_tokens=12,
                          **chosen)
    assert out == "def fib(n):" + expected.text + "\n"
    assert stats.startswith("[length] heads(k=3): 12 tokens in ") and "draft acceptance " in stats


def test_prompt_file_with_several_prompts(checkpoint, tmp_path, capsys):
    directory, _ = checkpoint
    file = tmp_path / "prompts.jsonl"
    file.write_text(json.dumps({"prompt": "import os\n"}) + "\n\n" + json.dumps("x = 1") + "\n")
    assert read_prompts(file) == ["import os\n", "x = 1"]
    main([f"checkpoint={directory}", f"prompt_file={file}", "max_new_tokens=3", "k=1",
          "temperature=0.8", "seed=1"])
    out, err = capsys.readouterr()
    assert "### prompt 0\nimport os\n" in out and "### prompt 1\nx = 1" in out
    assert err.count("autoregressive: 3 tokens in 3 forward passes (1.00 tokens/forward)") == 2


def test_argument_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="give exactly one of prompt=..., prompt_file=... and "):
        parse_args(["checkpoint=x"])
    with pytest.raises(ValueError, match="k must be an integer >= 1, 'auto' or None .* 'many'"):
        parse_args(["checkpoint=x", "prompt=a", "k=many"])
    with pytest.raises(ValueError, match="window=3 sizes lookahead, not drafter='heads'"):
        parse_args(["checkpoint=x", "prompt=a", "drafter=heads", "window=3"])
    with pytest.raises(ValueError, match="unknown key tempreature; known: acceptance, "):
        parse_args(["checkpoint=x", "prompt=a", "tempreature=1"])
    with pytest.raises(ValueError, match="dtype='int8' is not one of bfloat16, float16, "):
        parse_args(["checkpoint=x", "prompt=a", "dtype=int8"])
    with pytest.raises(ValueError, match="checkpoint=... is required"):
        parse_args(["prompt=a"])
    with pytest.raises(ValueError, match="max_new_tokens='many': Value 'many' of type"):
        parse_args(["checkpoint=x", "prompt=a", "max_new_tokens=many"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1 must be a JSON string or an object"):
        read_prompts(bad)


def test_missing_or_corrupt_checkpoint_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    for path in (tmp_path / "missing", tmp_path):
        result = subprocess.run(
            [sys.executable, "-m", "mtp.generate", f"checkpoint={path}", "prompt=x"],
            capture_output=True, text=True, check=False)
        assert result.returncode == 1
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_bf16_generation_runs(checkpoint):
    _, model = checkpoint
    [g] = generate(model.to(torch.bfloat16), ByteTokenizer(), ["ab"], max_new_tokens=5)
    assert g.stats.new_tokens == 5


def test_dtype_auto_says_what_it_measured(checkpoint, capsys):
    directory, _ = checkpoint
    main([f"checkpoint={directory}", "prompt='def f(x):'", "max_new_tokens=4", "k=3",
          "dtype=auto"])
    err = capsys.readouterr().err
    # bf16 is measured only where the CPU has bf16 arithmetic; float32 is measured anyway
    assert ("dtype: float32 (fixed: this CPU has no bf16 arithmetic)" in err
            or ", a forward of 3 tokens; ms: " in err)


def test_default_drafter_is_auto_and_names_its_choice(checkpoint, tmp_path, capsys,
                                                      monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    directory, _ = checkpoint
    main([f"checkpoint={directory}", "prompt='def f(x):'", "max_new_tokens=6"])
    err = capsys.readouterr().err
    [entry] = [e for e in json.loads((tmp_path / "tune.json").read_text()).values()
               if e["step"] == "drafter"]
    assert f"drafter: {entry['choice']} (measured in " in err
    assert f"auto -> {entry['choice']}: 6 tokens in " in err
    main([f"checkpoint={directory}", "prompt='def f(x):'", "max_new_tokens=6"])
    assert f"drafter: {entry['choice']} (cached, measured in " in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown drafter 'medusa': choose one of auto, "):
        main([f"checkpoint={directory}", "prompt=x", "drafter=medusa"])
    with pytest.raises(ValueError, match="max_ngram=0 must be a positive integer"):
        main([f"checkpoint={directory}", "prompt=x", "drafter=prompt_lookup", "max_ngram=0"])
