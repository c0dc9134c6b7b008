"""Data: sources through ``datasets``, tokenise + split + pack, the LightningDataModule
(``sources``, ``pipeline``, ``packing``, ``module``) and the paper's synthetic tasks
(``polynomial``, ``induction``)."""

from mtp.data.induction import InductionSource
from mtp.data.module import MTPDataModule, ResumableDataLoader, ResumableSampler, StreamingBlocks
from mtp.data.packing import PackedBlocks, num_blocks, pack_iter
from mtp.data.polynomial import PolynomialSource
from mtp.data.pipeline import PreparedCorpus, build_tokenizer, is_validation, prepare
from mtp.data.sources import (Corpus, HubSource, InstalledSource, LocalSource, Source,
                              StdlibSource, data_dir)

__all__ = ["Corpus", "HubSource", "InductionSource", "InstalledSource", "LocalSource",
           "MTPDataModule", "PackedBlocks", "PolynomialSource", "PreparedCorpus",
           "ResumableDataLoader", "ResumableSampler", "Source", "StdlibSource", "StreamingBlocks",
           "build_tokenizer", "data_dir", "is_validation", "num_blocks", "pack_iter", "prepare"]
