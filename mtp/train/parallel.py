"""FSDP2 sharding, mixed precision and activation checkpointing of an `MTPModel`, kept apart
from the model (torchtitan's `parallelize`).

Wrapping order, innermost first; each `fully_shard` call makes one unit whose parameters are
gathered just before it runs and whose gradients are reduce-scattered after its backward:

1. every trunk block (`model.layers[i]`);
2. every head (`model.heads[i]`, all of that head's blocks): the headwise loss runs each
   head's forward and backward in turn, so a head is gathered once and freed after it (a
   sequential module's input fusion, three small tensors, stays with the root);
3. the shared final norm and unembedding (`model.norm`, `model.output`) as one unit with
   `reshard_after_forward=False`: every head calls it, forward and backward, n times per
   step. With tied embeddings the input embedding joins this unit, since it holds the same
   weight;
4. the root (embedding and anything left), which also drives the per-step bookkeeping.
   `model.trunk` is registered as a forward method, because the headwise loss calls it
   instead of `model.forward`.

Activation checkpointing (`apply_activation_checkpointing`) comes before sharding, as in
torchtitan: a checkpointed block keeps only its input and recomputes the rest in backward.

The headwise backward is n + 1 backward calls per micro-batch (one per head, then the trunk).
FSDP2 ends every backward call by running the post-backward, and so the reduce-scatter, of
each unit that call did not reach, and re-gathers the shared unit for every head. Left alone
that costs n reduce-scatters of the V x D unembedding per step and, with gradient
accumulation, early reductions of every unit. `gradient_sync` turns that into one
reduce-scatter per parameter per optimizer step (docs/benchmarks.md has the counts).
Gradients equal the unsharded model's (tests/test_parallel.py checks both on 2 CPU ranks).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.utils.checkpoint import checkpoint

from mtp.model import MTPModel

ACTIVATION_CHECKPOINTING = ("none", "trunk", "all")
_HEADS_GATHERED: weakref.WeakSet = weakref.WeakSet()  # models whose heads were gathered once


def parallelize(model: MTPModel, mesh: DeviceMesh, *,
                mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True) -> MTPModel:
    """Shard `model` in place over the 1-D data-parallel `mesh` (order in the module docstring).

    Works on a model on the meta device (then `to_empty` and `init_weights()` afterwards) as on
    a materialised one. `reshard_after_forward` applies to the trunk blocks and heads; the
    tied or shared unembedding unit never reshards within a step.
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize needs a 1-D data-parallel mesh, got {mesh.ndim} dims "
                         f"({mesh.mesh_dim_names})")
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    for head in model.heads:
        # A head's ModuleList is never called itself: shard its blocks together as one unit.
        fully_shard(list(head), reshard_after_forward=reshard_after_forward, **kwargs)
    shared = [model.norm, model.output]
    if model.config.tie_embeddings:
        # A tied output weight is the embedding's: both modules gather it from one unit.
        shared.insert(0, model.tok_embeddings)
    fully_shard(shared, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    # The headwise loss calls `model.trunk`, never `model.forward`: let it gather the root.
    register_fsdp_forward_method(model, "trunk")
    # FSDP2 prefetches the next unit in backward from the forward order, which it forgets at
    # the end of every backward call: by the trunk's (the headwise loss's last) none is left.
    # Name each trunk block's predecessor instead, so its all-gather overlaps the backward.
    trunk = [model, *reversed(model.layers)]  # backward order: the root holds the trunk output
    for unit, previous in zip(trunk, trunk[1:]):
        unit.set_modules_to_backward_prefetch([previous])
    return model


def check_options(*, activation_checkpointing: str = "none", param_dtype: str = "auto",
                  reduce_dtype: str = "float32") -> None:
    """Fail early, naming the value, on an unknown activation checkpointing mode or dtype."""
    if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not one of "
                         f"{ACTIVATION_CHECKPOINTING}")
    mixed_precision("32-true", param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def mixed_precision(precision: str, *, param_dtype: str = "auto",
                    reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2's policy: gather and compute in `param_dtype`, reduce gradients in `reduce_dtype`.

    `param_dtype="auto"` is bfloat16 under a bf16 Lightning precision ("bf16-mixed",
    "bf16-true") and float32 otherwise. Sharded parameters and optimizer state stay float32.
    """
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if param_dtype == "auto":
        param_dtype = "bfloat16" if str(precision).startswith("bf16") else "float32"
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value not in dtypes:
            raise ValueError(f"fsdp.{name}={value!r} is not one of {sorted(dtypes)}"
                             f"{' or auto' if name == 'param_dtype' else ''}")
    return MixedPrecisionPolicy(param_dtype=dtypes[param_dtype],
                                reduce_dtype=dtypes[reduce_dtype])


def apply_activation_checkpointing(model: MTPModel, mode: str) -> None:
    """Recompute blocks in backward instead of keeping their activations: none|trunk|all.

    "trunk" checkpoints the trunk blocks, "all" the heads' blocks too. Each block keeps its
    input and recomputes its forward just before its own backward, so the headwise loss is
    unchanged: the trunk runs forward once, each head recomputes its blocks in its own
    backward, and the trunk's blocks are recomputed once, in the final trunk backward.
    Parameter names do not change (the block's `forward` is wrapped, not the block).
    """
    check_options(activation_checkpointing=mode)
    blocks = [] if mode == "none" else list(model.layers)
    if mode == "all":
        blocks += [block for head in model.heads for block in head]
    for block in blocks:
        # Non-reentrant: works with inputs that need no grad and composes with FSDP2's hooks,
        # which unshard the block before its recomputation.
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


@contextmanager
def gradient_sync(model: nn.Module, *, sync: bool, headwise: bool) -> Iterator[None]:
    """Around one micro-batch's loss and backward: reduce-scatter each parameter once per step.

    `sync`: this is the optimizer step's last micro-batch (gradients are reduced in it);
    earlier ones only accumulate. `headwise`: the loss backpropagates headwise ("headwise",
    "chunked"), n + 1 backward calls ending with the trunk's; False for one backward
    ("naive"), where FSDP's own `set_requires_gradient_sync` is all that is needed.

    In the headwise case every unit's sync stays off until that unit's last backward of the
    step: each head's at the start of its own (and only) backward, so its reduce-scatter
    overlaps the next head; the trunk blocks', the root's and the shared unit's when the
    gradient reaches the trunk output (the step's last backward call). The shared unit and
    the root also stay gathered from the first head's backward to the trunk's, instead of
    being re-gathered for every head. A no-op without FSDP. With the loss's early exit,
    head 0, the shared unit and the trunk's first segment run one more backward after the
    trunk's has begun, and reduce again (the gradients are the same).
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    if not headwise:
        model.set_requires_gradient_sync(sync)
        yield
        return
    if model not in _HEADS_GATHERED:
        # FSDP2 fails to defer the sync of a unit it has never gathered (no unsharded
        # parameters to accumulate into), which head i + 1 is during head i's first backward.
        for head in model.heads:
            head[-1].unshard()
            head[-1].reshard()
        _HEADS_GATHERED.add(model)
    gathered = [model, model.norm]  # the root and the shared norm/unembedding unit
    model.set_requires_gradient_sync(False)
    for unit in gathered:
        unit.set_reshard_after_backward(False, recurse=False)

    def trunk_backward_starts(grad: Tensor) -> Tensor:
        for unit in gathered:
            unit.set_reshard_after_backward(True, recurse=False)
        if sync:
            model.set_requires_gradient_sync(True)
        return grad

    hooks = [_on_output_grad(model.layers[-1] if len(model.layers) else model.tok_embeddings,
                             trunk_backward_starts)]
    if sync:
        for head in model.heads:
            unit = head[-1]  # any module of the head's unit; its last sees the gradient first
            hooks.append(_on_output_grad(unit, functools.partial(_enable_sync, unit)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for unit in gathered:
            unit.set_reshard_after_backward(True, recurse=False)
        model.set_requires_gradient_sync(True)


def _enable_sync(unit: FSDPModule, grad: Tensor) -> Tensor:
    unit.set_requires_gradient_sync(True, recurse=False)
    return grad


def _on_output_grad(module: nn.Module, fn: Any) -> torch.utils.hooks.RemovableHandle:
    """Call `fn(grad)` when the gradient of `module`'s output arrives (its backward starts)."""
    @torch.compiler.disable  # FSDP state changes belong outside a compiled block's graph
    def forward_hook(_module: nn.Module, _args: Any, output: Tensor) -> None:
        if output.requires_grad:
            output.register_hook(fn)
    return module.register_forward_hook(forward_hook)


def end_spawned_rank() -> NoReturn:
    """End a `torch.multiprocessing.spawn` worker that finished its work: wait for every rank,
    tear the process group down, and exit at once with status 0.

    The immediate exit skips the interpreter's finalization, where gloo (torch 2.13, CPU)
    aborts the process about one run in twenty ("terminate called without an active
    exception", after `destroy_process_group` has returned) and `spawn` then reports the
    whole job failed. Whatever the rank had to hand back must already be written (a
    `Manager` dict's writes are synchronous)."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
