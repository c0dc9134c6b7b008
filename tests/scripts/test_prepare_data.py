"""scripts/prepare_data.py: a table of figures and a final JSON line that add up."""

import json

import pytest
from script_modules import load_script  # tests/ is on the path

prepare_data = load_script("prepare_data")


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
    stats = prepare_data.main(["source=local", f"paths=[{corpus}]", f"tokenizer={tokenizer}",
                               "vocab_size=300", "seq_len=32", "n_future=4", "val_fraction=0.2",
                               f"cache_dir={tmp_path / 'cache'}"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == stats
    assert any(line.startswith("documents") for line in out)
    assert "files skipped: 1 not UTF-8" in out
    assert stats["train"]["documents"] + stats["val"]["documents"] == 20
    for split in ("train", "val"):
        s = stats[split]
        assert s["tokens"] == s["blocks"] * 32 + s["remainder_tokens"]


def test_bad_arguments_are_one_line_errors_naming_the_key():
    with pytest.raises(ValueError, match=r"source=local needs paths="):
        prepare_data.parse_args(["source=local"])
    with pytest.raises(ValueError, match="source='nowhere'"):
        prepare_data.parse_args(["source=nowhere"])
    with pytest.raises(ValueError, match="decontaminate: 'apps' is not one of "):
        prepare_data.parse_args(["source=installed", "decontaminate=[apps]"])
    with pytest.raises(ValueError, match="unknown key .*vocab"):
        prepare_data.parse_args(["vocab=3"])
