"""FLOPs per token against torch's FLOP counter; MFU and its peak presets."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mtp.train.flops import PEAK_FLOPS, flops_per_token, mfu, resolve_peak_flops
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.model import MTPConfig, MTPModel


@pytest.mark.parametrize(("n_future", "n_kv_heads", "head_layers", "head_type"), [
    (1, 4, 1, "block"), (4, 2, 1, "block"), (3, 1, 2, "block"), (3, 2, 1, "sequential")])
def test_formula_equals_torchs_flop_counter_for_a_training_step(
        n_future: int, n_kv_heads: int, head_layers: int, head_type: str) -> None:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                       max_seq_len=64, n_future=n_future, head_layers=head_layers,
                       head_type=head_type)
    model = MTPModel(config)
    batch, seq_len = 2, 24
    tokens = torch.randint(0, 262, (batch, seq_len + n_future))
    # The math backend runs attention as matrix products the counter sees (fused CPU
    # kernels are not counted); it counts the full T x T scores, as the formula does.
    for mode in ("headwise", "naive"):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            mtp_loss(model, tokens, mode=mode, backward=autograd_backward)
        assert counter.get_total_flops() == batch * seq_len * flops_per_token(config, seq_len)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            model(tokens[:, :seq_len])
    assert counter.get_total_flops() == batch * seq_len * flops_per_token(
        config, seq_len, training=False)


def test_hand_count_of_one_block_and_one_head() -> None:
    config = MTPConfig(vocab_size=100, dim=8, n_layers=0, n_heads=2, ffn_hidden=16,
                       max_seq_len=8, n_future=1)
    # q, k, v, o: 4 x (8 x 8); ffn: 3 x (8 x 16); scores + values: 2 x (T=4 x 2 heads x 4)
    block = 2 * (4 * 64 + 3 * 128) + 2 * (2 * 4 * 2 * 4)
    forward = block + 2 * 8 * 100
    assert flops_per_token(config, 4, training=False) == forward
    assert flops_per_token(config, 4) == 3 * forward


def test_peak_flops_presets_and_mfu() -> None:
    assert resolve_peak_flops("h100-bf16", "bf16-mixed") == PEAK_FLOPS["h100-bf16"] == 989.4e12
    assert resolve_peak_flops("a100-bf16", "bf16-mixed") == 312e12
    assert resolve_peak_flops(None, "32-true") is None
    assert resolve_peak_flops(1e12, "32-true") == 1e12
    assert resolve_peak_flops("cpu", "32-true") > 1e8  # measured: any CPU does 0.1 GFLOP/s
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="peak_flops='v100'"):
        resolve_peak_flops("v100", "32-true")
    with pytest.raises(ValueError, match="peak_flops=-1"):
        resolve_peak_flops(-1, "32-true")
