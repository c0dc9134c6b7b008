"""Packing: blocks tile the token stream, the streaming packer matches, bad sizes are named."""

import numpy as np
import pytest
import torch

from mtp.data import PackedBlocks, num_blocks, pack_iter


@pytest.mark.parametrize("n_tokens,seq_len,n_future", [(103, 8, 4), (12, 8, 4), (11, 8, 4), (64, 8, 1)])
def test_blocks_tile_the_stream_and_targets_are_real(n_tokens, seq_len, n_future):
    stream = np.arange(n_tokens, dtype=np.uint16) * 7 % 251
    blocks = PackedBlocks(stream, seq_len, n_future)
    assert len(blocks) == num_blocks(n_tokens, seq_len, n_future)
    tokens = torch.stack([blocks[j]["tokens"] for j in range(len(blocks))]) if len(blocks) else None
    covered = len(blocks) * seq_len
    remainder = n_tokens - covered
    assert remainder < seq_len + n_future  # only a partial block is left over
    if tokens is None:
        return
    assert tokens.shape == (len(blocks), seq_len + n_future)
    assert torch.equal(tokens[:, :seq_len].reshape(-1), torch.from_numpy(stream[:covered].astype(np.int64)))
    for j in range(len(blocks)):
        for t in range(seq_len):
            for i in range(n_future):  # head i at position t predicts stream[pos + i + 1]
                pos = j * seq_len + t
                assert tokens[j, t + i + 1] == stream[pos + i + 1]


def test_pack_iter_matches_packed_blocks():
    docs = [list(range(k, k + k % 7 + 1)) for k in range(40)]
    stream = np.array([t for d in docs for t in d])
    expected = PackedBlocks(stream, 5, 3)
    streamed = list(pack_iter(docs, 5, 3))
    assert len(streamed) == len(expected)
    assert all(torch.equal(a, expected[j]["tokens"]) for j, a in enumerate(streamed))


def test_block_args_are_validated():
    with pytest.raises(ValueError, match="seq_len"):
        PackedBlocks(np.zeros(10), 0, 1)
    with pytest.raises(ValueError, match="n_future"):
        PackedBlocks(np.zeros(10), 4, 0)
