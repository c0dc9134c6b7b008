import dataclasses
import json

import pytest
import torch
from torch import Tensor

from mtp.model import MTPConfig, MTPModel, apply_rope, rope_tables
from mtp.rope import RopeScaling


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


@pytest.mark.parametrize("head_type, blocks", [
    ("block", 19), ("sequential", 19), ("resblock", 12), ("linear", 12), ("medusa", 12)])
def test_added_heads_keep_head_0_at_the_whole_depth(head_type, blocks):
    """model.heads=added: trunk + head 0 is byte1's 12-block model whatever the heads, which
    come on top (block and sequential heads with their own blocks); head 0's parameters are
    named and shaped as the next-token model's, so its weights could be byte1's."""
    added = MTPConfig.from_depth(depth=12, heads="added", n_future=8, head_type=head_type,
                                 vocab_size=262, dim=32, n_heads=4)
    one = MTPConfig.from_depth(depth=12, heads="added", vocab_size=262, dim=32, n_heads=4)
    assert (added.n_layers, added.n_future, added.n_blocks) == (11, 8, blocks)
    assert one == MTPConfig.compute_matched(depth=12, vocab_size=262, dim=32, n_heads=4)
    base = {k: v.shape for k, v in MTPModel(one).state_dict().items()}
    assert {k: v.shape for k, v in MTPModel(added).state_dict().items()
            if MTPModel.is_base_parameter(k)} == base
    assert MTPConfig.from_depth(depth=12, n_future=8, vocab_size=262).n_layers == 4  # matched
    with pytest.raises(ValueError, match="model.heads='on_top' is not one of"):
        MTPConfig.from_depth(depth=12, heads="on_top", vocab_size=262)
    with pytest.raises(ValueError, match="depth=1 is too shallow for head 0's head_layers=2"):
        MTPConfig.added_heads(depth=1, head_layers=2, vocab_size=262)


@pytest.mark.parametrize("fields, message", [
    (dict(dim=30, n_heads=4), "dim=30 must be divisible by n_heads=4"),
    (dict(n_heads=4, n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
    (dict(n_future=0), "MTPConfig.n_future=0 must be a positive integer"),
    (dict(head_layers=0), "MTPConfig.head_layers=0 must be a positive integer"),
    (dict(vocab_size=-1), "MTPConfig.vocab_size=-1 must be a positive integer"),
    (dict(n_layers=-2), "MTPConfig.n_layers=-2 must be an integer >= 0"),
    (dict(dim=24, n_heads=8), "must be even for rotary"),
    (dict(norm_eps=0.0), "MTPConfig.norm_eps=0.0 must be a number > 0"),
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


def test_llama_variants_are_fields_that_round_trip():
    config = MTPConfig(vocab_size=262, dim=32, n_heads=4, n_kv_heads=2, head_dim=12,
                       qkv_bias=True, out_bias=True, mlp_bias=True,
                       rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_seq_len": 8192})
    assert isinstance(config.rope_scaling, RopeScaling)
    assert MTPConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    model = MTPModel(config)
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (4 * 12, 32) and attention.wo.weight.shape == (32, 48)
    assert all(b is not None and not b.any() for b in (attention.wq.bias, attention.wo.bias,
                                                        model.layers[0].feed_forward.w2.bias))
    assert MTPConfig(vocab_size=262, dim=30, n_heads=4, head_dim=8).head_dim == 8


@pytest.mark.parametrize("scaling, message", [
    ({"type": "yarn", "factor": 2.0}, "rope_scaling.type='yarn' is not one of"),
    ({"type": "linear"}, "needs 'type' and 'factor'"),
    ({"type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor is missing"),
    ({"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "is not a field of type 'linear'"),
    ({"type": "linear", "factor": 0}, "rope_scaling.factor=0.0 must be a number > 0"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_seq_len": 8192}, "high_freq_factor=1.0 must exceed low_freq_factor=4.0"),
    ({"type": "linear", "factor": 2.0, "beta": 1},
     r"unknown MTPConfig.rope_scaling field\(s\) \['beta'\]"),
])
def test_invalid_rope_scaling_names_the_field(scaling, message):
    with pytest.raises(ValueError, match=message):
        MTPConfig(vocab_size=262, rope_scaling=scaling)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0}, {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}], ids=["linear", "llama3"])
def test_rope_scaling_frequencies_equal_transformers(rope):
    """Llama 3.1 8B's rotary frequencies (head width 128, theta 5e5), as transformers has them."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                      max_position_embeddings=131072,
                                      rope_parameters={**rope, "rope_theta": 5e5})
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](theirs, "cpu")
    fields = {k: v for k, v in rope.items() if k not in ("rope_type",
                                                         "original_max_position_embeddings")}
    if "original_max_position_embeddings" in rope:
        fields["original_max_seq_len"] = rope["original_max_position_embeddings"]
    scaling = RopeScaling(type=rope["rope_type"], **fields)
    freqs = 1.0 / 5e5 ** (torch.arange(0, 128, 2).float() / 128)
    torch.testing.assert_close(scaling.frequencies(freqs), expected, rtol=1e-6, atol=0)


def _kernels_or_skip():
    from mtp import kernels

    if not kernels.active():
        pytest.skip(f"no compiled kernels here: {kernels.status().reason}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_on_the_kernels_a_cached_forward_agrees_with_torchs(tiny_config, dtype):
    """The kernels' cached forward (prefill, then a step of 3 tokens) gives torch's logits
    within the dtype's rounding; a training forward, which needs gradients, stays torch's."""
    from mtp.kv_cache import KVCache, cache_step, causal
    from mtp.model import decodes_on_kernels, use_kernels

    _kernels_or_skip()
    model = MTPModel(tiny_config).to(dtype)
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 12))

    def cached(on: bool) -> Tensor:
        use_kernels(model, on)
        assert decodes_on_kernels(model) is on
        cache = KVCache(tiny_config, 2, 32, dtype=dtype)
        with torch.inference_mode():
            first = model(tokens[:, :9], cache=cache, step=cache_step(
                torch.zeros(2, dtype=torch.long), *causal(9), key_len=9))
            then = model(tokens[:, 9:], cache=cache, step=cache_step(
                torch.full((2,), 9), *causal(3), key_len=12))
        return torch.cat([first, then], dim=1)

    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(cached(True), cached(False), **tolerance)
    use_kernels(model, True)
    training = model(tokens)  # gradients wanted: torch's path, bit for bit
    use_kernels(model, False)
    assert torch.equal(training, model(tokens))
    assert training.requires_grad


def test_on_the_kernels_a_changed_weight_is_packed_again(tiny_config):
    from mtp.model import use_kernels

    _kernels_or_skip()
    model = MTPModel(tiny_config)
    use_kernels(model, True)
    h = torch.randn(3, tiny_config.dim)
    with torch.no_grad():
        before = model.unembed(h)
        model.output.weight.mul_(2)  # in place, as an optimiser step
        torch.testing.assert_close(model.unembed(h), 2 * before, atol=1e-5, rtol=1e-5)
        model.to(torch.bfloat16)  # new storage in another dtype
        assert model.unembed(h.bfloat16()).dtype == torch.bfloat16


def test_use_kernels_says_why_not(tiny_config, monkeypatch):
    from mtp.model import decodes_on_kernels, use_kernels

    model = MTPModel(tiny_config)
    assert use_kernels(model, False) == "decoding through torch: kernels off as asked"
    assert not decodes_on_kernels(model)
    monkeypatch.setenv("MTP_KERNELS", "off")
    assert use_kernels(model, True) == "decoding through torch: MTP_KERNELS=off"
    assert "decoding through torch" in use_kernels(model.to(torch.float16), True)


def test_a_model_moved_to_a_kernel_dtype_is_marked_again(tiny_config):
    """A float64 model decodes through torch; its copy in float32 (as the tests' and
    `open_decoder`'s dtype variants make) on the kernels, as `generate` asks."""
    import copy

    from mtp.model import decodes_on_kernels, use_kernels

    _kernels_or_skip()
    model = MTPModel(tiny_config).double()
    assert "float64" in use_kernels(model) and not decodes_on_kernels(model)
    moved = copy.deepcopy(model).float()
    assert use_kernels(moved).startswith("decoding through mtp.kernels")
    assert decodes_on_kernels(moved)
    assert use_kernels(moved, False) and not decodes_on_kernels(moved)
    # asked off, it stays off in a copy in another dtype
    assert use_kernels(copy.deepcopy(moved).bfloat16()).startswith("decoding through torch")
