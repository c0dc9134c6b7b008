"""The sharded checkpoint folders `trainer=fsdp` writes, read in one process.

Lightning's `ModelParallelStrategy` saves a checkpoint as a folder: torch.distributed.checkpoint
(DCP) shards of the model and optimizer (`.metadata`, one `__<rank>_0.distcp` per rank) and
`meta.pt`, the rest of the Lightning checkpoint. DCP keeps global shapes, so `ckpt_path=`
resumes on any number of ranks and `read_sharded_checkpoint` gathers the full weights.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

META_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILE = ".metadata"
_MODEL_KEY = "state_dict"  # the model's entry in the DCP state (optimizers are optimizer_<i>)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint folder written by `ModelParallelStrategy`."""
    path = Path(path)
    return (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def read_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint dict of a sharded folder, with the model's full `state_dict`
    on CPU in its saved dtype (the optimizer's state is not read)."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder: it needs "
                                f"{META_FILE} and {DCP_METADATA_FILE}")
    try:
        checkpoint: dict[str, Any] = torch.load(path / META_FILE, map_location="cpu",
                                                weights_only=True)
        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata()
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise ValueError(f"cannot read {path} as a sharded checkpoint: {e}") from e
    prefix = f"{_MODEL_KEY}."
    state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{path} holds no model weights (no '{prefix}*' tensors)")
    # DCP flattens nested dicts with dots: {"state_dict": {name: t}} reads "state_dict.<name>".
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: it does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({_MODEL_KEY: state}, storage_reader=reader, no_dist=True)
    checkpoint[_MODEL_KEY] = state
    return checkpoint
