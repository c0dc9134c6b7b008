"""scripts/prepare_data.py: a table of figures and a final JSON line that add up."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"
spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
prepare_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_data)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(20):
        (root / f"m{i}.py").write_text("".join(f"x{i}_{j} = {j}\n" for j in range(30)))
    (root / "bad.py").write_bytes(b"\xff\xfe")
    return root


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prints_table_and_json(corpus, tmp_path, capsys, tokenizer):
    stats = prepare_data.main(["--source", "local", "--paths", str(corpus), "--tokenizer", tokenizer,
                               "--vocab-size", "300", "--seq-len", "32", "--n-future", "4",
                               "--val-fraction", "0.2", "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == stats
    assert any(line.startswith("documents") for line in out)
    assert "files skipped: 1 not UTF-8" in out
    assert stats["train"]["documents"] + stats["val"]["documents"] == 20
    for split in ("train", "val"):
        s = stats[split]
        assert s["tokens"] == s["blocks"] * 32 + s["remainder_tokens"]


def test_local_source_needs_paths():
    with pytest.raises(SystemExit, match="--paths"):
        prepare_data.main(["--source", "local"])
