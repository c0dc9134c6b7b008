"""Tokenise, split and write a corpus as two flat token streams, with statistics.

One cached ``datasets.map`` pass tokenises every document (EOS appended) and decides its
split; the streams are then written once as raw ``uint16``/``uint32`` files that training
memory-maps (nanoGPT's ``train.bin``). A document goes to validation when
``blake2b(seed, text)`` falls below ``val_fraction``: deterministic, per document, and fit
for streams. Layout under ``cache_dir`` (default ``$MTP_DATA_DIR`` or ``./data``)::

    <corpus key>/<tokenizer fingerprint>-val<fraction>-seed<seed>/
        tokens.arrow  train.bin  val.bin  meta.json
    <corpus key>/bpe<vocab>-val<fraction>-seed<seed>/tokenizer.json
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from mtp.cli import check_choice, check_number
from mtp.data.packing import num_blocks
from mtp.data.sources import Corpus, Source, data_dir
from mtp.tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

SPLITS = ("train", "val")
_STREAMING_BPE_DOCS = 100_000  # a streamed corpus trains BPE on its first documents


def is_validation(text: str, seed: int, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") < val_fraction * 2**64


def check_split_args(val_fraction: float, seed: int) -> None:
    check_number("val_fraction", val_fraction, lambda v: 0 <= v < 1, "in [0, 1)")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


@dataclass(frozen=True)
class PreparedCorpus:
    """The token streams of a prepared corpus and the figures behind them."""

    directory: Path
    meta: dict  # per split: documents, bytes, tokens; plus dtype, skipped, tokenizer

    def stream(self, split: str) -> np.memmap:
        """The split's token stream, memory-mapped read-only."""
        check_choice("split", split, SPLITS)
        if self.meta[split]["tokens"] == 0:
            return np.zeros(0, dtype=self.meta["dtype"])
        return np.memmap(self.directory / f"{split}.bin", dtype=self.meta["dtype"], mode="r")

    def stats(self, seq_len: int, n_future: int) -> dict:
        """Figures per split; ``tokens == blocks * seq_len + remainder_tokens`` always."""
        out = {"source": self.meta["source"], "tokenizer": self.meta["tokenizer"],
               "seq_len": seq_len, "n_future": n_future, "skipped": self.meta["skipped"]}
        for split in SPLITS:
            s = dict(self.meta[split])
            s["bytes_per_token"] = round(s["bytes"] / s["tokens"], 4) if s["tokens"] else 0.0
            s["blocks"] = num_blocks(s["tokens"], seq_len, n_future)
            s["remainder_tokens"] = s["tokens"] - s["blocks"] * seq_len
            out[split] = s
        return out


def prepare(corpus: Corpus, tokenizer: Tokenizer, *, val_fraction: float = 0.01, seed: int = 0,
            cache_dir: str | Path | None = None, num_proc: int | None = None) -> PreparedCorpus:
    """Tokenise ``corpus`` (cached), split it and write the train/val streams once."""
    check_split_args(val_fraction, seed)
    if corpus.streaming:
        raise ValueError("a streaming corpus is tokenised on the fly; prepare() needs a "
                         "map-style one")
    directory = _split_dir(corpus, cache_dir, tokenizer.fingerprint, val_fraction, seed)
    directory.mkdir(parents=True, exist_ok=True)
    tokenised = corpus.documents.map(
        _tokenise, batched=True,
        fn_kwargs={"tokenizer": tokenizer, "seed": seed, "val_fraction": val_fraction},
        remove_columns=corpus.documents.column_names,
        cache_file_name=str(directory / "tokens.arrow"),
        new_fingerprint=f"{directory.parent.name}-{directory.name}"[-64:], num_proc=num_proc,
        desc=f"tokenising {corpus.key} ({tokenizer.name})")
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        meta = _write_streams(tokenised, directory, tokenizer)
        meta.update(source=corpus.key, tokenizer=tokenizer.name, skipped=corpus.skipped,
                    contaminated=corpus.contaminated)
        tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, meta_path)  # meta.json last: its presence means the streams are whole
    return PreparedCorpus(directory, json.loads(meta_path.read_text()))


def build_tokenizer(kind: str = "byte", *, vocab_size: int = 32_000, path: str | None = None,
                    source: Source | None = None, val_fraction: float = 0.01, seed: int = 0,
                    cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer a run uses: byte, a BPE loaded from ``path``, or a BPE trained once on
    the training split of ``source`` and cached under the corpus's folder."""
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"tokenizer kind must be 'byte' or 'bpe', got {kind!r}")
    if path is not None:
        return load_tokenizer(path)
    if source is None:
        raise ValueError("training a BPE tokenizer needs a source (or give path= to a "
                         "tokenizer.json)")
    check_split_args(val_fraction, seed)
    corpus = source.load()
    directory = _split_dir(corpus, cache_dir, f"bpe{vocab_size}", val_fraction, seed)
    if not (directory / "tokenizer.json").is_file():
        texts = (t for t in _texts(corpus) if not is_validation(t, seed, val_fraction))
        if corpus.streaming:
            texts = itertools.islice(texts, _STREAMING_BPE_DOCS)
        BPETokenizer.train(texts, vocab_size).save(directory)
    return load_tokenizer(directory)


def _tokenise(batch: dict[str, list], tokenizer: Tokenizer, seed: int,
              val_fraction: float) -> dict[str, list]:
    """The ``datasets.map`` function: ids with EOS appended, UTF-8 bytes, split."""
    texts = batch["text"]
    return {"ids": [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(texts)],
            "n_bytes": [len(t.encode("utf-8")) for t in texts],
            "is_val": [is_validation(t, seed, val_fraction) for t in texts]}


def _write_streams(tokenised, directory: Path, tokenizer: Tokenizer) -> dict:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    # Per-process temporary names: runs started together (a sweep's parallel jobs) each write
    # whole streams and the last atomic replace wins with identical bytes.
    tmp = {split: directory / f"{split}.bin.{os.getpid()}.tmp" for split in SPLITS}
    files = {split: tmp[split].open("wb") for split in SPLITS}
    counts = {split: {"documents": 0, "bytes": 0, "tokens": 0} for split in SPLITS}
    for table in tokenised.with_format("arrow").iter(batch_size=10_000):
        is_val = table["is_val"]
        for split, mask in (("train", pc.invert(is_val)), ("val", is_val)):
            part = table.filter(mask)
            tokens = part["ids"].combine_chunks().flatten().to_numpy().astype(dtype)
            files[split].write(tokens.tobytes())
            counts[split]["documents"] += part.num_rows
            counts[split]["bytes"] += int(pc.sum(part["n_bytes"]).as_py() or 0)
            counts[split]["tokens"] += len(tokens)
    for split, f in files.items():
        f.close()
        os.replace(tmp[split], directory / f"{split}.bin")
    return {"dtype": np.dtype(dtype).name, **counts}


def _split_dir(corpus: Corpus, cache_dir: str | Path | None, name: str, val_fraction: float,
               seed: int) -> Path:
    root = Path(cache_dir) if cache_dir is not None else data_dir()
    return root / corpus.key / f"{name}-val{val_fraction:g}-seed{seed}"


def _texts(corpus: Corpus) -> Iterator[str]:
    for batch in corpus.documents.select_columns(["text"]).iter(batch_size=1000):
        yield from batch["text"]
