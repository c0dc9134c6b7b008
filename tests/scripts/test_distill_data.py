"""scripts/distill_data.py writes the base model's continuations as data=local reads them."""

import json
from pathlib import Path

import pytest
from script_modules import load_script  # tests/ is on the path

from mtp.checkpoint import export, load
from mtp.data import LocalSource, prepare
from mtp.generate import generate
from mtp.model import MTPConfig, MTPModel
from mtp.paths import mbpp_file
from mtp.tokenizers import ByteTokenizer

distill_data = load_script("distill_data")


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text("".join(f"value_{i}_{j} = {j}\n" for j in range(20)))
    config = MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=128,
                       n_future=2)
    return export(MTPModel(config), ByteTokenizer(), tmp_path / "export"), corpus


@pytest.mark.parametrize("sampled", [False, True])
def test_writes_what_the_local_source_reads(setup: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture, sampled: bool):
    checkpoint, corpus = setup
    out = tmp_path / "distilled" / "data.jsonl"
    argv = [f"checkpoint={checkpoint}", f"out={out}", "source=local", f"paths=[{corpus}]",
            "prompts=5", "prompt_chars=40", "max_new_tokens=12", "batch_size=2",
            "val_fraction=0", "threads=1"]
    if sampled:
        argv += ["temperature=0.8", "top_p=0.9"]
    stats = distill_data.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == stats
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == stats["prompts"] == 5
    assert 0 < stats["new_tokens"] <= 5 * 12
    sources = {p.name: p.read_text() for p in corpus.iterdir()}
    for record in records:
        assert record["text"] == record["prompt"] + record["continuation"]
        assert len(record["prompt"]) == 40
        assert record["prompt"] in sources[Path(record["source"]).name]
    if not sampled:  # greedy: exactly the model's own continuation
        model, tokenizer = load(checkpoint)
        expected = generate(model, tokenizer, [records[0]["prompt"]], max_new_tokens=12)
        assert records[0]["continuation"] == expected[0].text

    corpus_read = LocalSource(paths=[str(out)]).load()
    assert corpus_read.documents["text"] == [r["text"] for r in records]
    prepared = prepare(corpus_read, ByteTokenizer(), val_fraction=0.0, seed=0,
                       cache_dir=tmp_path / "cache")
    assert prepared.stats(16, 2)["train"]["documents"] == 5


def test_bad_arguments_are_named(setup: tuple[Path, Path], tmp_path: Path):
    checkpoint, corpus = setup
    common = [f"checkpoint={checkpoint}", f"out={tmp_path / 'x.jsonl'}", "source=local",
              f"paths=[{corpus}]", "threads=1"]
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        distill_data.parse_args([*common, "batch_size=0"])
    with pytest.raises(ValueError, match="prompts_from='lines' is not one of"):
        distill_data.parse_args([*common, "prompts_from=lines"])
    with pytest.raises(ValueError, match="temperature"):
        distill_data.parse_args([*common, "temperature=-1"])
    with pytest.raises(ValueError, match="out=... is required"):
        distill_data.parse_args([f"checkpoint={checkpoint}"])
    with pytest.raises(ValueError, match="no document is longer than prompt_chars=5000"):
        distill_data.main([*common, "prompt_chars=5000"])


@pytest.mark.skipif(mbpp_file() is None, reason="needs MBPP's mbpp.jsonl ($MTP_MBPP_FILE)")
def test_mbpp_prompts_come_from_the_train_split_only():
    prompts = distill_data.mbpp_prompts(mbpp_file(), 10_000, seed=0)
    ids = sorted(int(source.split("/")[1]) for source, _ in prompts)
    assert ids[0] >= 601 and ids[-1] <= 974 and len(ids) == 374  # never test or validation
    source, prompt = next(p for p in prompts if p[0] == "mbpp/912")  # a helper def comes first
    assert prompt == 'def lobb_num(n, m):\n    """Write a function to find ln, m lobb number."""\n'
