"""FSDP2 on 2 CPU ranks (gloo) gives the single-process loss and gradients, headwise backward."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from mtp.loss import autograd_backward, mtp_loss
from mtp.model import MTPConfig, MTPModel
from mtp.parallel import parallelize

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tie: bool) -> MTPConfig:
    return MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     max_seq_len=64, n_future=3, head_layers=2, tie_embeddings=tie)


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # Both layouts in one pair of processes: starting them is most of the cost.
        for tie in (False, True):
            _compare(rank, tie, results)
    finally:
        dist.destroy_process_group()


def _compare(rank: int, tie: bool, results: dict) -> None:
    torch.manual_seed(0)
    config = _config(tie)
    reference = MTPModel(config)
    tokens = torch.randint(0, config.vocab_size, (4, 16 + config.n_future))
    expected = mtp_loss(reference, tokens, backward=autograd_backward)

    sharded = MTPModel(config)
    sharded.load_state_dict(reference.state_dict())
    parallelize(sharded, init_device_mesh("cpu", (WORLD,)))
    mine = tokens.chunk(WORLD)[rank]  # each rank its half of the batch
    got = mtp_loss(sharded, mine, backward=autograd_backward)
    loss = got.loss.clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)

    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    if rank == 0:
        results[tie] = {"loss": (loss.item(), expected.loss.item()),
                        "grads": {name: (grads[name], p.grad)
                                  for name, p in reference.named_parameters()}}


@pytest.fixture(scope="module")
def two_rank_results() -> dict:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    return dict(results)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_two_rank_fsdp_matches_single_process(two_rank_results: dict, tie: bool) -> None:
    result = two_rank_results[tie]
    sharded_loss, single_loss = result["loss"]
    assert sharded_loss == pytest.approx(single_loss, rel=1e-6)
    grads = result["grads"]
    assert len(grads) == len(list(MTPModel(_config(tie)).parameters()))
    for name, (sharded, single) in grads.items():
        torch.testing.assert_close(sharded, single, rtol=1e-5, atol=1e-6, msg=name)
        assert single.abs().sum() > 0, name  # every parameter really trained
