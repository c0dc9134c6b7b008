"""Fixed-length training blocks cut from a token stream.

Block j of a stream ``s`` is ``s[j*T : j*T + T + n_future]`` (T = ``seq_len``): the inputs
and every head's real targets (no padding, no masks). Consecutive blocks overlap by
``n_future`` tokens; what is left, ``len(s) - blocks * T`` tokens, is the remainder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from mtp.cli import check_positive


def check_block_args(seq_len: int, n_future: int) -> None:
    check_positive("seq_len", seq_len)
    check_positive("n_future", n_future)


def num_blocks(n_tokens: int, seq_len: int, n_future: int) -> int:
    """How many full blocks a stream of ``n_tokens`` holds."""
    return max(0, (n_tokens - n_future) // seq_len)


class PackedBlocks(torch.utils.data.Dataset):
    """Map-style dataset of the blocks of one (memory-mapped) token stream."""

    def __init__(self, stream: np.ndarray, seq_len: int, n_future: int) -> None:
        check_block_args(seq_len, n_future)
        self.stream, self.seq_len, self.n_future = stream, seq_len, n_future

    def __len__(self) -> int:
        return num_blocks(len(self.stream), self.seq_len, self.n_future)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        if not 0 <= j < len(self):
            raise IndexError(f"block {j} out of range for {len(self)} blocks")
        start = j * self.seq_len
        end = start + self.seq_len + self.n_future
        block = np.asarray(self.stream[start:end], dtype=np.int64)
        # The index names the block for `mtp.train.trunk_cache`'s cache of its trunk output.
        return {"tokens": torch.from_numpy(block), "index": torch.tensor(j)}  # (T + n_future,)


def pack_iter(documents: Iterable[list[int]], seq_len: int,
              n_future: int) -> Iterator[torch.Tensor]:
    """The same blocks as ``PackedBlocks`` from a stream of tokenised documents (streaming)."""
    check_block_args(seq_len, n_future)
    buffer: list[int] = []
    width = seq_len + n_future
    for ids in documents:
        buffer.extend(ids)
        while len(buffer) >= width:
            yield torch.tensor(buffer[:width], dtype=torch.long)
            del buffer[:seq_len]  # keep the n_future look-ahead: it starts the next block
