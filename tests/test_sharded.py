"""mtp.load on sharded checkpoint folders (the layout Lightning's ModelParallelStrategy writes).

The folder here is written in one process with torch.distributed.checkpoint; a real 2-rank
trainer=fsdp folder is loaded in tests/train/test_train.py (slow).
"""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mtp.checkpoint import (META_FILE, is_sharded_checkpoint, load, read_sharded_checkpoint,
                            tokenizer_files)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer


def _write_sharded(model: MTPModel, folder: Path) -> None:
    """Model and optimizer states as DCP shards plus meta.pt, as ModelParallelStrategy saves."""
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
             "optimizer_0": {"state": {"step": torch.tensor(3.0)}}}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    meta = {"hyper_parameters": {"model": model.config.to_dict(), "seq_len": 16},
            "global_step": 3, "tokenizer_files": tokenizer_files(ByteTokenizer())}
    torch.save(meta, folder / META_FILE)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # saving in one process
@pytest.mark.parametrize("tie", [False, True])
def test_sharded_folder_loads_like_the_model(tmp_path: Path, tiny_config: MTPConfig,
                                             tie: bool) -> None:
    config = MTPConfig.from_dict({**tiny_config.to_dict(), "tie_embeddings": tie})
    model = MTPModel(config).eval()
    _write_sharded(model, tmp_path / "last.ckpt")
    assert is_sharded_checkpoint(tmp_path / "last.ckpt")
    loaded, tokenizer = load(tmp_path / "last.ckpt")
    assert loaded.config == config and isinstance(tokenizer, ByteTokenizer)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    checkpoint = read_sharded_checkpoint(tmp_path / "last.ckpt")
    assert checkpoint["global_step"] == 3
    assert not any("optimizer" in name for name in checkpoint["state_dict"])


def test_folders_that_are_not_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="none of the layouts.*sharded trainer=fsdp"):
        load(tmp_path)
    (tmp_path / META_FILE).write_bytes(b"not a checkpoint")
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="cannot read .* as a sharded checkpoint"):
        load(tmp_path)
