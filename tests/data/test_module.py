"""MTPDataModule: batches, rank disjointness, resume, streaming, Hydra configs."""

from pathlib import Path

import datasets
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from mtp.data import (
    Corpus, LocalSource, MTPDataModule, ResumableSampler, StreamingBlocks, build_tokenizer, prepare,
)
from mtp.tokenizers import ByteTokenizer

CONF = Path(__file__).resolve().parents[2] / "conf"
SEQ, N = 16, 4


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        # no repeated lines, so equal blocks can only come from the same document
        (root / f"m{i}.py").write_text("".join(f"v{i}_{j} = {i * j}\n" for j in range(i % 6 + 4)))
    return root


def make_module(corpus_dir, tmp_path, **kwargs):
    args = dict(source=LocalSource(paths=[str(corpus_dir)]), tokenizer=ByteTokenizer(), seq_len=SEQ,
                n_future=N, batch_size=4, val_fraction=0.1, seed=3, cache_dir=tmp_path)
    dm = MTPDataModule(**{**args, **kwargs})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_batches_have_the_contract_shape(corpus_dir, tmp_path):
    dm = make_module(corpus_dir, tmp_path)
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, SEQ + N) and batch["tokens"].dtype == torch.long
    val = next(iter(dm.val_dataloader()))
    assert val["tokens"].shape[1] == SEQ + N
    assert dm.prepared.stats(SEQ, N)["train"]["blocks"] == len(dm.train_set)


def test_one_epoch_visits_every_block_once(corpus_dir, tmp_path):
    dm = make_module(corpus_dir, tmp_path, batch_size=1)
    seen = [b["tokens"] for b in dm.train_dataloader()]
    blocks = [dm.train_set[j]["tokens"] for j in range(len(dm.train_set))]
    key = lambda t: tuple(t.view(-1).tolist())  # noqa: E731
    assert sorted(map(key, seen)) == sorted(map(key, blocks))


def test_ranks_see_disjoint_blocks_and_epochs_reshuffle(corpus_dir, tmp_path):
    dm = make_module(corpus_dir, tmp_path)
    ranks = [ResumableSampler(dm.train_set, num_replicas=2, rank=r, seed=3) for r in (0, 1)]
    idx = [list(s) for s in ranks]
    assert len(idx[0]) == len(idx[1]) > 0
    assert not set(idx[0]) & set(idx[1])
    ranks[0].set_epoch(1)
    assert list(ranks[0]) != idx[0]
    assert list(ResumableSampler(dm.train_set, num_replicas=2, rank=0, seed=3)) == idx[0]


def test_resume_continues_with_the_next_batch(corpus_dir, tmp_path):
    loader = make_module(corpus_dir, tmp_path).train_dataloader()
    loader.sampler.set_epoch(2)
    uninterrupted = [b["tokens"] for b in loader]
    k = 3
    partial = make_module(corpus_dir, tmp_path).train_dataloader()
    partial.sampler.set_epoch(2)
    it = iter(partial)
    for _ in range(k):
        next(it)
    state = partial.state_dict()
    assert state == {"epoch": 2, "batches": k}

    fresh = make_module(corpus_dir, tmp_path).train_dataloader()
    fresh.load_state_dict(state)
    resumed = [b["tokens"] for b in fresh]
    assert len(resumed) == len(uninterrupted) - k
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[k:]))
    assert fresh.state_dict() == {"epoch": 2, "batches": len(uninterrupted)}
    assert len(list(fresh)) == len(uninterrupted)  # the next epoch starts from its beginning


def test_too_small_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_module(tmp_path / "src", tmp_path / "cache", seq_len=64)


def test_bad_arguments_name_the_value(corpus_dir, tmp_path):
    with pytest.raises(ValueError, match="val_fraction.*1.5"):
        MTPDataModule(LocalSource(paths=[str(corpus_dir)]), ByteTokenizer(), SEQ, N, val_fraction=1.5)
    with pytest.raises(ValueError, match="batch_size.*0"):
        MTPDataModule(LocalSource(paths=[str(corpus_dir)]), ByteTokenizer(), SEQ, N, batch_size=0)


def test_streaming_blocks_match_prepared_blocks_and_split_ranks(corpus_dir, tmp_path):
    local = LocalSource(paths=[str(corpus_dir)]).load()
    streamed_docs = datasets.Dataset.from_dict({"text": local.documents["text"]}).to_iterable_dataset(num_shards=2)
    corpus = Corpus(streamed_docs, "stream-test")
    tok = ByteTokenizer()
    args = dict(seq_len=SEQ, n_future=N, val_fraction=0.1, seed=3)
    val = [b["tokens"] for b in StreamingBlocks(corpus, tok, split="val", rank=0, world_size=1, **args)]
    prepared = prepare(local, tok, val_fraction=0.1, seed=3, cache_dir=tmp_path)
    expected = make_module(corpus_dir, tmp_path).val_set
    assert len(val) == len(expected) > 0
    assert all(torch.equal(a, expected[j]["tokens"]) for j, a in enumerate(val))
    assert prepared.meta["val"]["tokens"] == len(prepared.stream("val"))
    per_rank = [[tuple(b["tokens"].tolist()) for b in StreamingBlocks(
        corpus, tok, split="train", rank=r, world_size=2, **args)] for r in (0, 1)]
    assert per_rank[0] and per_rank[1] and not set(per_rank[0]) & set(per_rank[1])


@pytest.mark.parametrize("data", ["stdlib", "local", "hub"])
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_configs_compose_and_build(data, tokenizer, corpus_dir, tmp_path):
    """The recipe train.py follows: tokenizer first (the model needs its vocab), then the module."""
    overrides = [f"data={data}", f"tokenizer={tokenizer}", f"data.cache_dir={tmp_path}"]
    if tokenizer == "bpe":
        overrides.append("tokenizer.vocab_size=300")
    if data == "local":
        overrides.append(f"data.source.paths=[{corpus_dir}]")
    if data == "hub":
        overrides.append("data.source.name=someone/corpus")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(overrides=[f"+{o}" if o.startswith(("data=", "tokenizer=")) else o for o in overrides])
    source = instantiate(cfg.data.source)
    assert type(source).__name__.lower().startswith({"stdlib": "stdlib", "local": "local", "hub": "hub"}[data])
    if data != "local":
        return  # building those needs the stdlib scan or the Hub; covered elsewhere
    tok = build_tokenizer(**cfg.tokenizer, source=source, val_fraction=cfg.data.val_fraction,
                          seed=cfg.data.seed, cache_dir=cfg.data.cache_dir)
    dm = instantiate(cfg.data, tokenizer=tok, seq_len=SEQ, n_future=N)
    assert isinstance(dm, MTPDataModule) and dm.source == source
    dm.prepare_data()
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["tokens"].max() < tok.vocab_size


class _Recorder(__import__("lightning").LightningModule):
    """The smallest trainable module; remembers the first token of every batch it trains on."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, _):
        self.seen.append(batch["tokens"][:, :8].clone())
        return (self.w * batch["tokens"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_resumes_mid_epoch_at_the_next_batch(corpus_dir, tmp_path):
    """Lightning saves the loader's position in a mid-epoch checkpoint and restores it."""
    import lightning as L

    def fit(ckpt_path=None):
        module = _Recorder()
        every3 = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, callbacks=[every3])
        dm = MTPDataModule(LocalSource(paths=[str(corpus_dir)]), ByteTokenizer(), SEQ, N, batch_size=2,
                           val_fraction=0.1, seed=3, cache_dir=tmp_path)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module.seen

    full = fit()
    (mid,) = (tmp_path / "ckpt").glob("*step=3.ckpt")
    resumed = fit(ckpt_path=mid)
    assert len(full) == 6 and len(resumed) == 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[3:]))
