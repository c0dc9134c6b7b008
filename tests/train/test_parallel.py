"""FSDP2 on 2 CPU ranks (gloo): the single-process gradients, one reduce-scatter per parameter.

One pair of processes runs every case (starting them is most of the cost); each case trains
one optimizer step of `accumulate` micro-batches through `mtp.train.parallel.gradient_sync`, as
`MTPLitModule.training_step` does, and reports its gradients and the collectives it issued.
"""

import os
import socket
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from mtp.train.loss import autograd_backward, mtp_loss
from mtp.model import MTPConfig, MTPModel
from mtp.train.parallel import (apply_activation_checkpointing, end_spawned_rank, gradient_sync,
                          mixed_precision, parallelize)

WORLD = 2
N_FUTURE = 3


@dataclass(frozen=True)
class Case:
    tie: bool = False
    mode: str = "headwise"
    accumulate: int = 1
    bf16: bool = False
    checkpointing: str = "none"
    head_type: str = "block"
    early_exit: int | None = None


CASES = {
    "untied": Case(),
    "tied-accumulate": Case(tie=True, accumulate=2),
    "chunked-accumulate": Case(mode="chunked", accumulate=2),
    "naive-accumulate": Case(mode="naive", accumulate=2),
    "checkpointing": Case(checkpointing="all", accumulate=2),
    "bf16": Case(bf16=True),
    "sequential-accumulate": Case(head_type="sequential", accumulate=2),
    "early-exit-accumulate": Case(early_exit=1, accumulate=2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(case: Case) -> MTPConfig:
    return MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     max_seq_len=64, n_future=N_FUTURE, head_layers=2, tie_embeddings=case.tie,
                     head_type=case.head_type)


class Collectives:
    """Counts FSDP's all-gathers and reduce-scatters, and which parameters each reduced."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.reduced: Counter = Counter()  # parameter name -> reduce-scatters
        for name in ("all_gather_single", "reduce_scatter_single"):
            setattr(dist, name, self._counting(name, getattr(dist, name)))
        reduce = _fsdp_param_group.foreach_reduce

        def foreach_reduce(fsdp_params, *args, **kwargs):
            self.reduced.update(p._param_fqn for p in fsdp_params)
            return reduce(fsdp_params, *args, **kwargs)
        _fsdp_param_group.foreach_reduce = foreach_reduce

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    def clear(self) -> None:
        self.calls.clear()
        self.reduced.clear()


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    collectives = Collectives()
    try:
        for name, case in CASES.items():
            result = _run(rank, case, collectives)
            if rank == 0:
                results[name] = result
        end_spawned_rank()
    finally:  # reached only when the work above raised
        dist.destroy_process_group()


def _step(model: MTPModel, batches: list[torch.Tensor], case: Case) -> None:
    """One optimizer step's backward, as MTPLitModule.training_step runs it."""
    weights = [1 / case.accumulate] * N_FUTURE
    for i, tokens in enumerate(batches):
        with gradient_sync(model, sync=i == len(batches) - 1, headwise=case.mode != "naive"):
            mtp_loss(model, tokens, mode=case.mode, weights=weights, backward=autograd_backward,
                     chunk_size=24, early_exit=case.early_exit,
                     early_exit_weight=1 / case.accumulate)


def _run(rank: int, case: Case, collectives: Collectives) -> dict:
    torch.manual_seed(0)
    config = _config(case)
    reference = MTPModel(config)
    batches = [torch.randint(0, config.vocab_size, (4, 16 + N_FUTURE))
               for _ in range(case.accumulate)]
    _step(reference, batches, case)

    sharded = MTPModel(config)
    sharded.load_state_dict(reference.state_dict())
    apply_activation_checkpointing(sharded, case.checkpointing)
    policy = mixed_precision("bf16-mixed") if case.bf16 else MixedPrecisionPolicy()
    parallelize(sharded, init_device_mesh("cpu", (WORLD,)), mp_policy=policy)
    mine = [tokens.chunk(WORLD)[rank] for tokens in batches]  # each rank its half
    _step(sharded, mine, case)  # the first step builds FSDP's state: count the second
    sharded.zero_grad(set_to_none=True)
    collectives.clear()
    _step(sharded, mine, case)

    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    return {"calls": dict(collectives.calls), "reduced": dict(collectives.reduced),
            "units": _units(sharded),
            "grads": {name: (grads[name], p.grad) for name, p in reference.named_parameters()}}


def _units(model: MTPModel) -> int:
    """FSDP units holding parameters: trunk blocks, heads, shared unembedding, root."""
    return len(model.layers) + len(model.heads) + 1 + (not model.config.tie_embeddings)


@pytest.fixture(scope="module")
def two_rank_results() -> dict:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    return dict(results)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.bf16])
def test_two_rank_fsdp_gradients_match_single_process(two_rank_results: dict,
                                                      name: str) -> None:
    grads = two_rank_results[name]["grads"]
    assert len(grads) == len(list(MTPModel(_config(CASES[name])).parameters()))
    for param, (sharded, single) in grads.items():
        torch.testing.assert_close(sharded, single, rtol=1e-5, atol=1e-6, msg=param)
        assert single.abs().sum() > 0, param  # every parameter really trained


@pytest.mark.parametrize("name", [name for name, case in CASES.items()
                                  if case.mode != "naive" and case.early_exit is None])
def test_one_reduce_scatter_per_parameter_per_step(two_rank_results: dict, name: str) -> None:
    """Headwise: n + 1 backward calls per micro-batch, yet each unit reduces once per step.
    (An early exit backpropagates through head 0, the shared unit and the first trunk
    segment after the trunk's backward has begun: those reduce again, 11 reduce-scatters for
    7 units here, with the same gradients.)"""
    result = two_rank_results[name]
    assert result["calls"]["reduce_scatter_single"] == result["units"], result["calls"]
    assert result["reduced"] == dict.fromkeys(result["grads"], 1)


def test_shared_unembedding_is_gathered_once_per_micro_batch(two_rank_results: dict) -> None:
    # Forward: root, trunk blocks, heads, shared unit once; backward: each head and trunk
    # block again (resharded after forward). Without gradient_sync the shared unit is
    # re-gathered for every head and the root once more for the trunk's backward.
    config = _config(Case())
    expected = 1 + 2 * (config.n_layers + config.n_future) + 1
    assert two_rank_results["untied"]["calls"]["all_gather_single"] == expected
    # Recomputing checkpointed blocks in backward gathers nothing more.
    assert two_rank_results["checkpointing"]["calls"]["all_gather_single"] == 2 * expected


def test_bf16_mixed_precision_is_close_to_float32(two_rank_results: dict) -> None:
    """param_dtype=bfloat16 gathers and computes in bf16; reduce_dtype=float32 grads."""
    grads = two_rank_results["bf16"]["grads"]
    for param, (sharded, single) in grads.items():
        assert sharded.dtype == torch.float32, param
        error = (sharded - single).norm() / single.norm()
        assert error < 3e-2, (param, error.item())
    # bf16 really was used: not bit-equal to the float32 gradients.
    assert any(not torch.equal(sharded, single) for sharded, single in grads.values())


def test_mixed_precision_policy_choice() -> None:
    assert mixed_precision("bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision("bf16-true").reduce_dtype == torch.float32
    assert mixed_precision("32-true").param_dtype == torch.float32
    assert mixed_precision("bf16-mixed", param_dtype="float32").param_dtype == torch.float32
    with pytest.raises(ValueError, match="fsdp.reduce_dtype='fp16'"):
        mixed_precision("bf16-mixed", reduce_dtype="fp16")


@pytest.mark.parametrize("mode", ["trunk", "all"])
def test_activation_checkpointing_keeps_gradients_and_names(tiny_config: MTPConfig,
                                                            mode: str) -> None:
    reference = MTPModel(tiny_config)
    checkpointed = MTPModel(tiny_config)
    checkpointed.load_state_dict(reference.state_dict())
    apply_activation_checkpointing(checkpointed, mode)
    assert checkpointed.state_dict().keys() == reference.state_dict().keys()
    runs = Counter()  # attention forwards per block: twice when recomputed in backward
    for name, module in checkpointed.named_modules():
        if name.endswith("attention"):
            module.register_forward_hook(lambda m, *_, name=name: runs.update([name]))
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 16 + tiny_config.n_future))
    for model in (reference, checkpointed):
        mtp_loss(model, tokens, backward=autograd_backward)
    for name, count in runs.items():
        recomputed = name.startswith("layers") or mode == "all"
        assert count == (2 if recomputed else 1), (name, count)
    for (name, p), q in zip(reference.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="activation_checkpointing='heads'"):
        apply_activation_checkpointing(reference, "heads")
