"""``MTPDataModule``: batches ``{"tokens": LongTensor (B, seq_len + n_future)}``.

Map-style sources are prepared once (``pipeline.prepare``) into memory-mapped token streams.
``ResumableSampler`` (a ``DistributedSampler``, so Lightning keeps it) gives each rank a
disjoint slice of a permutation seeded by ``seed + epoch``; Lightning checkpoints
``ResumableDataLoader``'s ``state_dict()`` (the epoch and the batches handed out), so a resumed
run continues with the very next batch. Streaming Hub sources are tokenised and packed on the
fly (``StreamingBlocks``), sharded across ranks and dataloader workers; a resumed streamed
epoch restarts from its beginning.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader, DistributedSampler

from mtp.cli import check_positive
from mtp.data.packing import PackedBlocks, check_block_args, pack_iter
from mtp.data.pipeline import PreparedCorpus, check_split_args, is_validation, prepare
from mtp.data.sources import Corpus, Source
from mtp.tokenizers import Tokenizer

_SHUFFLE_BUFFER = 10_000  # documents held by a streamed corpus's shuffle buffer


class ResumableSampler(DistributedSampler):
    """Seeded, per-rank disjoint shuffling that can start part-way into an epoch."""

    def __init__(self, dataset: PackedBlocks, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.start = 0  # samples of this rank's epoch to skip, set by a restore

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0  # only the epoch being resumed skips ahead
        return iter(indices[start:])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose position can be saved and restored."""

    sampler: ResumableSampler

    def __init__(self, dataset: PackedBlocks, *, sampler: ResumableSampler, batch_size: int,
                 num_workers: int = 0) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                         drop_last=True, persistent_workers=num_workers > 0)
        self._batches = 0  # batches handed out in the current epoch

    def __iter__(self) -> Iterator[Any]:
        self._batches = self.sampler.start // self.batch_size
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches": self._batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.sampler.start = state["batches"] * self.batch_size


class StreamingBlocks(torch.utils.data.IterableDataset):
    """Blocks of a streamed corpus: this rank's documents of one split, tokenised and packed."""

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer, *, split: str, seq_len: int,
                 n_future: int, val_fraction: float, seed: int, rank: int, world_size: int) -> None:
        check_block_args(seq_len, n_future)
        documents = split_dataset_by_node(corpus.documents, rank=rank, world_size=world_size)
        if split == "train":
            documents = documents.shuffle(seed=seed, buffer_size=_SHUFFLE_BUFFER)
        self.documents, self.tokenizer, self.val = documents, tokenizer, split == "val"
        self.seq_len, self.n_future = seq_len, n_future
        self.val_fraction, self.seed = val_fraction, seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        texts = (t for t in (row["text"] for row in self.documents)
                 if t and t.strip() and is_validation(t, self.seed, self.val_fraction) == self.val)
        ids = (self.tokenizer.encode(t) + [self.tokenizer.eos_id] for t in texts)
        for block in pack_iter(ids, self.seq_len, self.n_future):
            yield {"tokens": block}


class MTPDataModule(L.LightningDataModule):
    """Training and validation blocks of ``source`` for a model with ``n_future`` heads."""

    def __init__(self, source: Source, tokenizer: Tokenizer, seq_len: int, n_future: int,
                 batch_size: int = 8, val_fraction: float = 0.01, seed: int = 0,
                 num_workers: int = 0, cache_dir: str | Path | None = None,
                 num_proc: int | None = None) -> None:
        super().__init__()
        check_block_args(seq_len, n_future)
        check_split_args(val_fraction, seed)
        if hasattr(source, "check_tokenizer"):  # a synthetic task: can the tokenizer spell it?
            source.check_tokenizer(tokenizer)
        check_positive("batch_size", batch_size)
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.n_future, self.batch_size = seq_len, n_future, batch_size
        self.val_fraction, self.seed = val_fraction, seed
        self.num_workers, self.cache_dir, self.num_proc = num_workers, cache_dir, num_proc
        self.prepared: PreparedCorpus | None = None
        self.train_set: torch.utils.data.Dataset | None = None
        self.val_set: torch.utils.data.Dataset | None = None

    def prepare_data(self) -> None:
        """Tokenise and write the streams (Lightning calls this on one process per node)."""
        corpus = self.source.load()
        if not corpus.streaming:
            self._prepare(corpus)

    def setup(self, stage: str | None = None) -> None:
        corpus = self.source.load()
        rank, world_size = self._rank_and_world()
        if corpus.streaming:
            self.train_set, self.val_set = (
                StreamingBlocks(corpus, self.tokenizer, split=split, seq_len=self.seq_len,
                                n_future=self.n_future, val_fraction=self.val_fraction,
                                seed=self.seed, rank=rank, world_size=world_size)
                for split in ("train", "val"))
            return
        self.prepared = self._prepare(corpus)
        self.train_set, self.val_set = (
            PackedBlocks(self.prepared.stream(split), self.seq_len, self.n_future)
            for split in ("train", "val"))
        if len(self.train_set) < world_size * self.batch_size:
            tokens = self.prepared.meta["train"]["tokens"]
            raise ValueError(
                f"corpus {corpus.key} has {tokens} training tokens: {len(self.train_set)} blocks "
                f"of seq_len {self.seq_len} + n_future {self.n_future}, fewer than one batch of "
                f"{self.batch_size} per rank on {world_size} rank(s)")

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.train_set, StreamingBlocks):
            return self._loader(self.train_set)
        rank, world_size = self._rank_and_world()
        sampler = ResumableSampler(self.train_set, num_replicas=world_size, rank=rank,
                                   seed=self.seed)
        return ResumableDataLoader(self.train_set, sampler=sampler, batch_size=self.batch_size,
                                   num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if isinstance(self.val_set, StreamingBlocks):
            return self._loader(self.val_set)
        if len(self.val_set) == 0:
            return []  # Lightning then skips validation
        rank, world_size = self._rank_and_world()
        sampler = DistributedSampler(self.val_set, num_replicas=world_size, rank=rank,
                                     shuffle=False)
        return self._loader(self.val_set, sampler=sampler)

    def _loader(self, dataset: torch.utils.data.Dataset, **kwargs: Any) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers,
                          **kwargs)

    def _prepare(self, corpus: Corpus) -> PreparedCorpus:
        return prepare(corpus, self.tokenizer, val_fraction=self.val_fraction, seed=self.seed,
                       cache_dir=self.cache_dir, num_proc=self.num_proc)

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1
