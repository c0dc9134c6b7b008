"""Shared fixtures: one tiny model config and fixed seeds for every test."""

import os
import random
import tempfile

import pytest
import torch
from hypothesis import settings

import mtp.tune

from mtp.train.loss import autograd_backward, mtp_loss
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

# Measured choices (threads, drafters) go to a cache of the session's own, inherited by the
# commands tests start, never to the user's ~/.cache/mtp.
os.environ["MTP_CACHE"] = tempfile.mkdtemp(prefix="mtp-test-cache-")

# Tiny models on a shared 2-core machine: one thread avoids spinning, and is faster.
torch.set_num_threads(1)

# Property tests check results, not timing: a per-example deadline fails them at random on a
# loaded machine.
settings.register_profile("mtp", deadline=None)
settings.load_profile("mtp")


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread_as_set():
    """Every test starts with the tests' one thread as the user's own setting (a test that
    has mtp set a count, or measure one, leaves no trace for the next)."""
    yield
    torch.set_num_threads(1)
    mtp.tune._ours = None


@pytest.fixture
def tiny_config() -> MTPConfig:
    """2 trunk layers, width 32, byte vocabulary (262), 4 heads of one block each."""
    return MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     max_seq_len=64, n_future=4, head_layers=1)


DOCS = ["def add(a, b):\n    return a + b\n", "print('héllo wörld €')\n",
        "for i in range(10):\n    print(i)\n"]


def recite_docs(n_future: int, dim: int, steps: int, head_type: str = "block") -> MTPModel:
    """A byte model trained for a few seconds to recite DOCS (EOS after each), float64."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=dim, n_layers=2, n_heads=4, max_seq_len=96,
                       n_future=n_future, head_type=head_type)
    model = MTPModel(config)
    recite(model, DOCS, steps)
    return model.double().eval()


def recite(model: MTPModel, docs: list[str], steps: int) -> None:
    """Train the model's trainable parameters to recite `docs` (bytes, EOS after each)."""
    tokenizer = ByteTokenizer()
    stream = torch.tensor([t for _ in range(20) for doc in docs
                           for t in tokenizer.encode(doc) + [tokenizer.eos_id]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - 36, (16,)).tolist()
        mtp_loss(model, torch.stack([stream[s:s + 36] for s in starts]),
                 backward=autograd_backward)
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="session")
def trained() -> MTPModel:
    """4 heads that have learnt DOCS: most of their drafts are kept.

    300 steps: at 120 the recitation depended on the CPU's arithmetic (it failed on an Intel
    machine and passed on an AMD one); at 300 it holds in float32 and float64 alike.
    """
    return recite_docs(n_future=4, dim=32, steps=300)


@pytest.fixture(scope="session")
def trained_sequential() -> MTPModel:
    """4 sequential heads (DeepSeek-V3's modules) that have learnt DOCS."""
    return recite_docs(n_future=4, dim=32, steps=150, head_type="sequential")


@pytest.fixture(scope="session")
def trained_draft() -> MTPModel:
    """A smaller one-head model trained briefly on DOCS: a draft model that often agrees."""
    return recite_docs(n_future=1, dim=16, steps=60)
