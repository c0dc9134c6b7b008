"""generate(): greedy speculative equals autoregressive, batching, stopping, streaming, errors."""

import pytest
import torch
from decode.common import TOKENIZER, ids_of

from mtp.generate import DecodeStats, DrafterSpec, HeadsDrafter, SamplingConfig, generate
from mtp.decode.forward import prefill
from mtp.decode.loop import SequenceOutput
from mtp.decode.tree import Calibration, resolve_tree
from mtp.kv_cache import KVCache
from mtp.model import MTPConfig, MTPModel


def heads(k):
    """The heads drafter with k tokens per forward (1: autoregressive decoding)."""
    return None if k == 1 else HeadsDrafter(k)


def tree_drafter(tree, k=None):
    return DrafterSpec(drafter="heads", tree=tree, k=k)


@torch.no_grad()
def test_prefill_equals_full_recomputation_for_ragged_prompts(random_model):
    prompts = [[258, 1, 2, 3, 4, 5], [258, 9, 8]]
    cache = KVCache(random_model.config, 2, 16, dtype=torch.float64)
    lengths, hidden, _ = prefill(random_model, cache, prompts, 3, pad_id=256)
    logits = random_model.unembed(hidden)  # (B, T, 3, V)
    for row, ids in enumerate(prompts):
        full = random_model(torch.tensor([ids]))[0, :, :3]  # (T, 3, V)
        torch.testing.assert_close(logits[row, :len(ids)], full)
    assert lengths.tolist() == [6, 3]


def test_greedy_speculative_equals_autoregressive_on_a_random_model(random_model):
    prompts = ["def f(x):", "a", "import torch\nimport numpy"]
    reference = generate(random_model, TOKENIZER, prompts, max_new_tokens=24)
    for k in range(2, random_model.config.n_future + 1):
        generations = generate(random_model, TOKENIZER, prompts, max_new_tokens=24,
                               drafter=heads(k))
        assert ids_of(generations) == ids_of(reference), f"k={k}"
        assert [g.text for g in generations] == [g.text for g in reference]
        for g in generations:
            assert 1 <= g.stats.tokens_per_forward <= k


def test_greedy_speculative_equals_autoregressive_on_a_trained_model(trained):
    prompts = ["def add(", "print('h", "for i", "zzz"]  # the last is off-distribution
    reference = generate(trained, TOKENIZER, prompts, max_new_tokens=48)
    assert reference[0].text == "a, b):\n    return a + b\n"
    assert reference[0].finish_reason == "eos" and reference[0].token_ids[-1] == 258
    for k in range(2, 5):
        generations = generate(trained, TOKENIZER, prompts, max_new_tokens=48,
                               drafter=heads(k))
        assert ids_of(generations) == ids_of(reference), f"k={k}"
    # The heads have learnt the documents: most drafts are kept.
    assert generations[0].stats.tokens_per_forward > 2.5
    assert min(generations[0].stats.head_acceptance) > 0.5


TREES = ["chain", "tree8", "tree16", "tree32", "tree64",
         [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 1]]]


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_greedy_tree_equals_autoregressive(random_model, trained, tree):
    """Every preset on a random and a trained model, ragged batches, up to the context end."""
    for model, prompts in ((random_model, ["def f(x):", "a", "import torch\nimport numpy"]),
                           (trained, ["def add(", "print('h", "for i", "zzz"])):
        reference = generate(model, TOKENIZER, prompts, max_new_tokens=48)
        generations = generate(model, TOKENIZER, prompts, max_new_tokens=48,
                               drafter=tree_drafter(tree))
        assert ids_of(generations) == ids_of(reference), tree
        [alone] = generate(model, TOKENIZER, prompts[:1], max_new_tokens=48,
                               drafter=tree_drafter(tree))
        assert alone.token_ids == reference[0].token_ids
    if tree != "chain":  # the trained heads' second choices are sometimes right
        stats = DecodeStats.pooled([g.stats for g in generations])
        chain = DecodeStats.pooled([g.stats for g in generate(
            trained, TOKENIZER, prompts, max_new_tokens=48, drafter=heads(4))])
        assert stats.tokens_per_forward >= chain.tokens_per_forward - 0.05


def test_auto_tree_from_a_calibration_and_typical_greedy(trained):
    rates = [[0.6, 0.2, 0.1], [0.7, 0.1, 0.05], [0.8, 0.1, 0.05]]
    tree = resolve_tree("auto:12", k=4, vocab_size=262,
                        calibration=Calibration(rates, n_future=4, vocab_size=262))
    prompts = ["for i in range(", "d"]
    reference = generate(trained, TOKENIZER, prompts, max_new_tokens=40)
    assert ids_of(generate(trained, TOKENIZER, prompts, max_new_tokens=40,
                         drafter=HeadsDrafter(4, tree))) \
        == ids_of(reference)
    typical = generate(trained, TOKENIZER, prompts, max_new_tokens=40,
                       drafter=HeadsDrafter(4, tree), acceptance="typical")
    assert ids_of(typical) == ids_of(reference)  # at temperature 0 typical acceptance is greedy
    sampled = generate(trained, TOKENIZER, prompts, max_new_tokens=40,
                       drafter=HeadsDrafter(4, tree), seed=0, acceptance="typical",
                       sampling=SamplingConfig(temperature=0.8))
    assert all(g.stats.tokens_per_forward > 1 for g in sampled)


def test_tree_statistics(trained):
    [g] = generate(trained, TOKENIZER, ["def add("], drafter=tree_drafter("tree16"),
                   max_new_tokens=40)
    s = g.stats
    assert sum(s.accepted_depths) == s.forward_passes
    # every forward pass gives its accepted drafts and one token (the last may be cut short)
    assert s.new_tokens <= sum((d + 1) * count for d, count in enumerate(s.accepted_depths))
    assert s.nodes_verified == 1 + 16 * (s.forward_passes - 1)
    assert s.nodes_per_forward == s.nodes_verified / s.forward_passes
    assert s.head_verified[0] == s.forward_passes >= s.head_verified[1]
    depth = resolve_tree("tree16", k=trained.config.n_future, vocab_size=trained.config.vocab_size).depth
    # one entry per depth, not per node: accepting d drafts needs a path of depth d
    assert len(s.accepted_depths) == len(s.head_acceptance) == depth + 1 < 16


@pytest.mark.parametrize("k", [1, 4])
def test_ragged_batch_equals_one_by_one(trained, k):
    prompts = ["for i in range(", "d", "print('héllo", "qq"]
    together = generate(trained, TOKENIZER, prompts, max_new_tokens=30, drafter=heads(k))
    alone = [generate(trained, TOKENIZER, [p], max_new_tokens=30, drafter=heads(k))[0] for p in prompts]
    assert ids_of(together) == ids_of(alone)
    assert [g.finish_reason for g in together] == [g.finish_reason for g in alone]


def test_stop_string_spanning_accepted_tokens_is_cut(trained):
    streamed = []
    outputs = {k: generate(trained, TOKENIZER, ["def add("], drafter=heads(k), stop=["return", "zz"],
                           on_text=lambda i, text: streamed.append(text))[0] for k in (1, 4)}
    for g in outputs.values():
        assert g.text == "a, b):\n    "
        assert g.finish_reason == "stop"
        assert TOKENIZER.decode(g.token_ids).endswith("return")  # ends where the stop does
    assert outputs[4].token_ids == outputs[1].token_ids
    assert outputs[4].stats.tokens_per_forward > 1  # several tokens were accepted at once
    # Text that turned out to be a stop string was never streamed.
    assert "".join(streamed) == "a, b):\n    " * 2


def test_max_new_tokens_is_never_exceeded(trained):
    for k in (1, 4):
        [g] = generate(trained, TOKENIZER, ["for i"], max_new_tokens=5, drafter=heads(k))
        assert g.text == " in r" and g.finish_reason == "length"
        assert g.stats.new_tokens == 5


def test_context_limit_stops_without_crashing(trained):
    prompt = "def add(a, b):\n    return a + b\n" * 2 + "for i in range(10):\n"  # 85 bytes
    for k in (1, 4):
        [g] = generate(trained, TOKENIZER, [prompt], max_new_tokens=50, drafter=heads(k))
        assert g.finish_reason == "context"
        assert 1 + len(prompt) + len(g.token_ids) == trained.config.max_seq_len


def test_byte_model_streams_only_whole_characters(trained):
    pieces = []
    [g] = generate(trained, TOKENIZER, ["print('h"], drafter=heads(4),
                   on_text=lambda i, text: pieces.append(text))
    assert g.text == "éllo wörld €')\n"
    assert "".join(pieces) == g.text and all("\ufffd" not in p for p in pieces)


def test_incomplete_utf8_is_held_back():
    pieces = []
    output = SequenceOutput(0, TOKENIZER, budget=10, budget_reason="length", stop=(),
                            positions=1, on_text=lambda i, text: pieces.append(text), started=0.0)
    euro = list("€".encode())  # three bytes
    output.add(euro[:1])
    output.add(euro[1:2])
    assert pieces == []
    output.add(euro[2:] + [ord("!")])
    assert pieces == ["€!"]


def test_statistics(trained):
    ar, spec = (generate(trained, TOKENIZER, ["def add(", "for i"], drafter=heads(k))
                for k in (1, 4))
    for g in ar:
        assert g.stats.forward_passes == g.stats.new_tokens and g.stats.tokens_per_forward == 1
    for g in spec:
        s = g.stats
        assert s.forward_passes < s.new_tokens <= 4 * s.forward_passes
        assert len(s.head_acceptance) == 4 and s.head_acceptance[0] == 1.0
        assert s.head_verified[0] == s.forward_passes >= s.head_verified[1] >= s.head_verified[3]
        assert s.seconds > 0
    pooled = DecodeStats.pooled([g.stats for g in spec])
    assert pooled.new_tokens == sum(g.stats.new_tokens for g in spec)
    assert pooled.tokens_per_forward == pooled.new_tokens / pooled.forward_passes


@pytest.mark.parametrize("kwargs, message", [
    ({"prompts": [""]}, "prompt 0 must be a non-empty string, got ''"),
    ({"prompts": "def f():"}, "prompts must be a non-empty list of strings"),
    ({"prompts": []}, "prompts must be a non-empty list of strings"),
    ({"prompts": ["x" * 64]}, "prompt 0 is 65 tokens .* max_seq_len=64"),
    ({"drafter": DrafterSpec(drafter="heads", k=5)}, "k must be from 1 to n_future=4, got k=5"),
    ({"drafter": "auto"}, "chosen by measurement: use mtp.generate.auto"),
    ({"drafter": "fast"}, "unknown drafter 'fast'"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be a positive integer"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty strings, got ''"),
    ({"drafter": tree_drafter([[0], [0, 0]], k=2)}, r"path \[0, 0\] has depth 2, but heads 1..1"),
    ({"drafter": tree_drafter([[0], [300]])}, r"path \[300\] has rank 300, beyond the vocab"),
    ({"drafter": tree_drafter("auto:16")}, "needs measured acceptance rates"),
    ({"acceptance": "medusa"}, "acceptance must be one of"),
])
def test_bad_arguments_are_clear_errors(random_model, kwargs, message):
    arguments = {"prompts": ["def f():"], **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(random_model, TOKENIZER, arguments.pop("prompts"), **arguments)


def test_tokenizer_must_match_the_model(tiny_config):
    model = MTPModel(MTPConfig(**{**tiny_config.to_dict(), "vocab_size": 300}))
    with pytest.raises(ValueError, match="has 262 tokens but the model's vocab_size is 300"):
        generate(model, TOKENIZER, ["x"])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1"):
        generate(model, TOKENIZER, ["x"], sampling=SamplingConfig(temperature=-1))


def test_the_step_is_compiled_by_default_on_a_gpu_only() -> None:
    from mtp.generate import DecodeSettings

    assert DecodeSettings(device="cuda").compiled and DecodeSettings(device="cuda:1").compiled
    assert not DecodeSettings(device="cpu").compiled
    assert DecodeSettings(compile=True).compiled
    assert not DecodeSettings(device="cuda", compile=False).compiled
