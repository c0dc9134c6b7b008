"""FSDP2 sharding of an `MTPModel`, kept apart from the model (torchtitan's `parallelize`).

Wrapping order, innermost first; each `fully_shard` call makes one unit whose parameters are
gathered just before it runs and whose gradients are reduce-scattered after its backward:

1. every trunk block (`model.layers[i]`);
2. every head (`model.heads[i]`, all of that head's blocks): the headwise loss runs each
   head's forward and backward in turn, so a head is gathered once and freed after it;
3. the shared final norm and unembedding (`model.norm`, `model.output`) as one unit with
   `reshard_after_forward=False`: every head calls it, forward and backward, n times per
   step, and keeping it gathered for the whole step avoids n all-gathers and keeps its
   gradient the sum over all heads (FSDP2 accumulates each backward into the sharded grad).
   With tied embeddings the input embedding joins this unit, since it holds the same weight;
4. the root (embedding and anything left), which also drives the per-step bookkeeping.
   `model.trunk` is registered as a forward method, because the headwise loss calls it
   instead of `model.forward`.

Gradients equal the unsharded model's (tests/test_parallel.py checks this on 2 CPU ranks).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from mtp.model import MTPModel


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
    return model
