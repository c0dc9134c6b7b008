"""mtp.train.memory: the step-memory lower bound holds, and a run that cannot fit fails first."""

from types import SimpleNamespace

import pytest
import torch

from mtp.train.memory import ACTIVATION_BYTES, GIB, check_fits, count_parameters, step_memory
from mtp.model import MTPConfig, MTPModel
from mtp.train.run import compose, train


def saved_activation_bytes(config: MTPConfig, batch: int, seq_len: int) -> int:
    """Bytes the trunk's forward saves for its backward under bf16 autocast, per token
    tensors only (the autocast weight copies are counted by `states`, not here)."""
    model = MTPModel(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() % (batch * seq_len) == 0 and tensor.shape[0] == batch:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.trunk(tokens)
    return sum(saved.values())


def test_the_activation_floor_is_below_what_a_block_saves() -> None:
    config = MTPConfig(vocab_size=262, dim=128, n_layers=3, n_heads=2, max_seq_len=64)
    measured = saved_activation_bytes(config, batch=2, seq_len=64)
    floor = ACTIVATION_BYTES * config.dim * 2 * 64 * config.n_layers
    assert floor <= measured < 3 * floor  # a floor, and not a vacuous one


def test_states_are_sharded_and_frozen_parameters_keep_no_optimizer_state() -> None:
    config = MTPConfig(vocab_size=262, dim=64, n_layers=2, n_heads=4, n_future=4)
    total, base = count_parameters(config)
    assert total == MTPModel(config).num_params() and 0 < base < total
    one = step_memory(config, batch=2, seq_len=32)
    assert one.states == 16 * total
    assert step_memory(config, batch=2, seq_len=32, ranks=4).states == 16 * total // 4
    frozen = step_memory(config, batch=2, seq_len=32, freeze_trunk=True)
    assert frozen.states == 16 * (total - base) + 4 * base and frozen.activations < one.activations
    assert step_memory(config, batch=2, seq_len=32, loss_mode="naive").logits == 4 * one.logits
    assert step_memory(config, batch=2, seq_len=32, loss_mode="chunked").logits == 0
    assert step_memory(config, batch=2, seq_len=32,
                       activation_checkpointing="all").activations == 0


def test_a_step_that_cannot_fit_is_named() -> None:
    config = MTPConfig(vocab_size=262, dim=64, n_layers=2, n_heads=4)
    memory = step_memory(config, batch=8, seq_len=1024)
    check_fits(memory, capacity=memory.total, device="cuda:0", what="m")
    with pytest.raises(ValueError, match=r"^m needs at least .* GiB per device .* more than "
                                         r"cuda:0's 0\.1 GiB: lower data\.batch_size"):
        check_fits(memory, capacity=memory.total - 1, device="cuda:0", what="m")


def test_train_refuses_a_gpu_preset_beyond_the_device_before_reading_data(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """trainer=gpu model=7b on an 80 GB GPU: 6.7B parameters need 100 GiB of states alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda _: SimpleNamespace(total_memory=80 * GIB, name="H100 (stand-in)"))
    cfg = compose(["+experiment=byte8", "trainer=gpu", "model=7b", f"run_dir={tmp_path}",
                   "data.source.paths=[/nonexistent]"])  # reading it would fail differently
    with pytest.raises(ValueError, match=r"the model \(6\d{3}\.\dM parameters\) at data\."
                                         r"batch_size=8 x seq_len=8192 needs at least .* than "
                                         r"cuda:0 \(H100 \(stand-in\)\)'s 80\.0 GiB"):
        train(cfg)
    assert not any(tmp_path.iterdir())
