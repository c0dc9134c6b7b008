"""Shared fixtures: one tiny model config and fixed seeds for every test."""

import random

import pytest
import torch

from mtp.model import MTPConfig

# Tiny models on a shared 2-core machine: one thread avoids spinning, and is faster.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def tiny_config() -> MTPConfig:
    """2 trunk layers, width 32, byte vocabulary (262), 4 heads of one block each."""
    return MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     max_seq_len=64, n_future=4, head_layers=1)
