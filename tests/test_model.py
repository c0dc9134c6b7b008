import dataclasses

import pytest
import torch

from mtp.model import MTPConfig, MTPModel, apply_rope, rope_tables


def test_changing_a_future_token_never_changes_earlier_logits(tiny_config):
    model = MTPModel(tiny_config).eval()
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % tiny_config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)  # (B, T, n, V)
    torch.testing.assert_close(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_forward_shapes_and_head_selection(tiny_config):
    model = MTPModel(tiny_config)
    tokens = torch.randint(0, tiny_config.vocab_size, (3, 7))
    assert model(tokens).shape == (3, 7, 4, 262)
    with torch.no_grad():
        all_heads, some = model(tokens), model(tokens, heads=[2, 0])
    torch.testing.assert_close(some[:, :, 0], all_heads[:, :, 2])
    torch.testing.assert_close(some[:, :, 1], all_heads[:, :, 0])


def test_rope_preserves_norms_and_depends_on_relative_position():
    cos, sin = rope_tables(head_dim=8, max_len=32, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def rotated(x, pos):
        return apply_rope(x, cos[pos:pos + 1], sin[pos:pos + 1])

    torch.testing.assert_close(rotated(q, 5).norm(), q.norm())
    dot = lambda m, n: (rotated(q, m) * rotated(k, n)).sum()  # noqa: E731
    torch.testing.assert_close(dot(7, 3), dot(24, 20))
    torch.testing.assert_close(rotated(q, 0), q)  # position 0 is the identity


def test_parameter_count_matches_the_architecture(tiny_config):
    c = tiny_config
    hd = c.head_dim
    attention = c.dim * c.n_heads * hd * 2 + c.dim * c.n_kv_heads * hd * 2
    block = attention + 3 * c.dim * c.ffn_hidden + 2 * c.dim
    expected = 2 * c.vocab_size * c.dim + c.n_blocks * block + c.dim
    model = MTPModel(c)
    assert c.n_blocks == 2 + 4
    assert model.num_params() == expected
    assert model.num_params(embeddings=False) == expected - c.vocab_size * c.dim
    tied = MTPModel(dataclasses.replace(c, tie_embeddings=True))
    assert tied.num_params() == expected - c.vocab_size * c.dim


def test_compute_matched_takes_the_extra_heads_off_the_trunk():
    base = MTPConfig.compute_matched(depth=12, vocab_size=262)
    mtp = MTPConfig.compute_matched(depth=12, n_future=8, vocab_size=262)
    assert (base.n_layers, base.n_future) == (11, 1)
    assert (mtp.n_layers, mtp.n_future) == (4, 8)
    assert base.n_layers + base.n_future == mtp.n_layers + mtp.n_future == 12
    with pytest.raises(ValueError, match="depth=3"):
        MTPConfig.compute_matched(depth=3, n_future=4, vocab_size=262)


@pytest.mark.parametrize("fields, message", [
    (dict(dim=30, n_heads=4), "dim=30 must be divisible by n_heads=4"),
    (dict(n_heads=4, n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
    (dict(n_future=0), "n_future must be a positive integer, got 0"),
    (dict(head_layers=0), "head_layers must be a positive integer, got 0"),
    (dict(vocab_size=-1), "vocab_size must be a positive integer, got -1"),
    (dict(n_layers=-2), "n_layers must be an integer >= 0, got -2"),
    (dict(dim=24, n_heads=8), "must be even for rotary"),
    (dict(norm_eps=0.0), "norm_eps must be a number > 0, got 0.0"),
])
def test_invalid_configs_name_the_field_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        MTPConfig(**{"vocab_size": 262, **fields})


def test_config_is_frozen_and_round_trips_through_a_dict(tiny_config):
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config.dim = 64
    assert MTPConfig.from_dict(tiny_config.to_dict()) == tiny_config
    with pytest.raises(ValueError, match="unknown MTPConfig field"):
        MTPConfig.from_dict({**tiny_config.to_dict(), "n_experts": 8})


def test_sequence_longer_than_the_context_is_rejected(tiny_config):
    model = MTPModel(tiny_config)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_meta_device_init_then_materialise_matches_shapes(tiny_config):
    with torch.device("meta"):
        model = MTPModel(tiny_config)
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = torch.randint(0, 262, (1, 5))
    assert torch.isfinite(model(tokens)).all()
    torch.testing.assert_close(model.rope_cos, rope_tables(8, 64, 10000.0)[0])


def test_rope_tables_stay_float32_when_the_model_is_cast(tiny_config):
    model = MTPModel(tiny_config).to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32
    assert model.output.weight.dtype == torch.bfloat16
