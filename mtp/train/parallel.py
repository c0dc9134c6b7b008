"""FSDP2 sharding, mixed precision and activation checkpointing of an `MTPModel`, kept apart
from the model (torchtitan's `parallelize`).

FSDP units, innermost first: every trunk block; every head (the headwise loss runs one head at
a time); the shared final norm and unembedding (with a tied input embedding), never resharded
within a step since every head calls it; the root, with `model.trunk` as a forward method.
The headwise backward is n + 1 backward calls per micro-batch, each of which FSDP2 ends by
reduce-scattering every unit it did not reach: `gradient_sync` makes that one reduce-scatter
per parameter per optimizer step (docs/benchmarks.md). Gradients equal the unsharded model's.
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

from mtp.cli import DTYPES, check_choice
from mtp.model import MTPModel

ACTIVATION_CHECKPOINTING = ("none", "trunk", "all")
_HEADS_GATHERED: weakref.WeakSet = weakref.WeakSet()  # models whose heads were gathered once


def parallelize(model: MTPModel, mesh: DeviceMesh, *,
                mp_policy: MixedPrecisionPolicy | None = None) -> MTPModel:
    """Shard `model` in place over the 1-D data-parallel `mesh` (on the meta device or not)."""
    if mesh.ndim != 1:
        raise ValueError(f"parallelize needs a 1-D data-parallel mesh, got {mesh.ndim} dims "
                         f"({mesh.mesh_dim_names})")
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True, **kwargs)
    for head in model.heads:
        # A head's ModuleList is never called itself: shard its blocks together as one unit.
        fully_shard(list(head), reshard_after_forward=True, **kwargs)
    shared = [model.norm, model.output]
    if model.config.tie_embeddings:
        # A tied output weight is the embedding's: both modules gather it from one unit.
        shared.insert(0, model.tok_embeddings)
    fully_shard(shared, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    # The headwise loss calls `model.trunk`, never `model.forward`: let it gather the root.
    register_fsdp_forward_method(model, "trunk")
    # FSDP2 forgets the forward order at the end of every backward call, so by the trunk's
    # (the last) it prefetches nothing: name each trunk block's predecessor instead.
    trunk = [model, *reversed(model.layers)]  # backward order: the root holds the trunk output
    for unit, previous in zip(trunk, trunk[1:]):
        unit.set_modules_to_backward_prefetch([previous])
    return model


def check_options(*, activation_checkpointing: str = "none", param_dtype: str = "auto",
                  reduce_dtype: str = "float32") -> None:
    """Fail early, naming the value, on an unknown activation checkpointing mode or dtype."""
    check_choice("activation_checkpointing", activation_checkpointing, ACTIVATION_CHECKPOINTING)
    mixed_precision("32-true", param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def mixed_precision(precision: str, *, param_dtype: str = "auto",
                    reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2's policy: gather and compute in `param_dtype` ("auto": bfloat16 under a bf16
    Lightning precision, else float32), reduce gradients in `reduce_dtype`."""
    dtypes = {name: DTYPES[name] for name in ("float32", "bfloat16")}  # what FSDP2 gathers in
    if param_dtype == "auto":
        param_dtype = "bfloat16" if str(precision).startswith("bf16") else "float32"
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        check_choice(f"fsdp.{name}", value, sorted(dtypes),
                     "or auto" if name == "param_dtype" else "")
    return MixedPrecisionPolicy(param_dtype=dtypes[param_dtype],
                                reduce_dtype=dtypes[reduce_dtype])


def apply_activation_checkpointing(model: MTPModel, mode: str) -> None:
    """Recompute blocks in backward instead of keeping their activations: "trunk" the trunk's
    blocks, "all" the heads' too; `forward` is wrapped, so parameter names stay."""
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

    `sync`: the step's last micro-batch. `headwise`: n + 1 backward calls ending with the
    trunk's; each unit's sync stays off until its last backward of the step (a head's own,
    the trunk's, root's and shared unit's when the gradient reaches the trunk output), the
    root and shared unit gathered meanwhile. A no-op without FSDP.
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
    """End a finished spawned worker with `os._exit(0)`: gloo's finalization (torch 2.13, CPU)
    aborts about one run in twenty. What the rank hands back must already be written."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
