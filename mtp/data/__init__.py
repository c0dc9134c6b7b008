"""Data: sources through ``datasets``, tokenise + split + pack, and the LightningDataModule.

- ``sources``: ``StdlibSource`` (the embedded default), ``InstalledSource`` (all installed
  Python, deduplicated and decontaminated: ``decontaminate``), ``LocalSource``, ``HubSource``.
- ``pipeline``: ``prepare`` (cached tokenisation, deterministic split, token streams,
  statistics) and ``build_tokenizer``.
- ``packing``: blocks of ``seq_len + n_future`` tokens that overlap by ``n_future``.
- ``polynomial``, ``induction``: the paper's synthetic tasks as sources (``PolynomialSource``,
  ``InductionSource``), generated from a seed with a fixed, disjoint test side.
- ``module``: ``MTPDataModule``, rank-aware and resumable.
"""

from mtp.data.induction import InductionSource
from mtp.data.module import MTPDataModule, ResumableDataLoader, ResumableSampler, StreamingBlocks
from mtp.data.packing import PackedBlocks, num_blocks, pack_iter
from mtp.data.polynomial import PolynomialSource
from mtp.data.pipeline import PreparedCorpus, build_tokenizer, is_validation, prepare
from mtp.data.sources import (Corpus, HubSource, InstalledSource, LocalSource, Source,
                              StdlibSource, data_dir)

__all__ = [
    "Corpus", "HubSource", "InductionSource", "InstalledSource", "LocalSource", "MTPDataModule",
    "PackedBlocks", "PolynomialSource", "PreparedCorpus", "ResumableDataLoader",
    "ResumableSampler", "Source", "StdlibSource", "StreamingBlocks", "build_tokenizer",
    "data_dir", "is_validation", "num_blocks", "pack_iter", "prepare",
]
