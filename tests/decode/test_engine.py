"""The decode step with static shapes: the same tokens as the eager step, for every drafter.

`compile=True` runs the step with static shapes (attention over the whole preallocated cache,
finished rows masked until the batch fits a smaller power of two) and compiles it. Most tests
here swap the compiled function for its eager original, so that the static path runs in
seconds; a slow test compiles for real, and GPU tests (marked `gpu`) capture CUDA graphs.
"""

import pytest
import torch

import mtp.decode.engine as engine
from mtp.generate import (Combined, DraftModel, DrafterSpec, HeadsDrafter, LayerSkip,
                          Lookahead, PromptLookup, SamplingConfig, generate)
from mtp.decode.engine import rebuild_size
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()
# Ragged, with the last two reaching the context's end (96 tokens) at different steps.
PROMPTS = ["def add(", "print('h", "for i", "zzz", "x" * 52, "y" * 70]


def _ids(generations):
    return [g.token_ids for g in generations]


@pytest.fixture
def static(monkeypatch):
    """compile=True runs the static step eagerly; records the shapes it ran. Each test counts
    its own shapes: the session's models would otherwise reach MAX_SHAPES across tests."""
    shapes = []

    def step(model, cache, lengths, root, active, drafts, draws, tree, buffers, heads,
             acceptance, key_len, *rest):
        shapes.append((lengths.shape[0], drafts.count + 1, key_len, cache.max_len))
        return engine.verify_and_accept(model, cache, lengths, root, active, drafts, draws,
                                        tree, buffers, heads, acceptance, key_len, *rest)

    monkeypatch.setattr(engine, "_compiled", {False: engine.CompiledStep(step)})
    return shapes


def _drafters(draft):
    return {"autoregressive": None, "heads": HeadsDrafter(4), "tree": DrafterSpec(
        drafter="heads", tree="tree16"), "prompt_lookup": PromptLookup(num_draft=5),
        "lookahead": Lookahead(4, 3, 2), "draft_model": DraftModel(draft, TOKENIZER, 3),
        "layer_skip": LayerSkip([1], 3),
        "heads+prompt_lookup": Combined(HeadsDrafter(3), PromptLookup())}


@pytest.mark.parametrize("name", ["autoregressive", "heads", "tree", "prompt_lookup",
                                  "lookahead", "draft_model", "layer_skip",
                                  "heads+prompt_lookup"])
def test_static_step_equals_the_eager_step_for_every_drafter(trained, trained_draft, static,
                                                             name):
    drafter = _drafters(trained_draft)[name]
    eager = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48, drafter=drafter,
                     stop=["print"])
    reference = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48, stop=["print"])
    assert _ids(eager) == _ids(reference)
    got = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48, drafter=drafter,
                   stop=["print"], compile=True)
    assert _ids(got) == _ids(reference)
    assert [g.finish_reason for g in got] == [g.finish_reason for g in reference]
    assert {"eos", "stop", "context"} <= {g.finish_reason for g in got}
    assert [g.stats.forward_passes for g in got] == [g.stats.forward_passes for g in eager]
    batches, widths, keys, caches = zip(*static)
    assert len(set(widths)) == 1 and len(set(keys)) == 1 and keys == caches  # one shape,
    assert set(batches) <= {6, 4, 2, 1}  # but for the batch: 6, then powers of two
    assert list(batches) == sorted(batches, reverse=True)


def test_finished_rows_stay_masked_until_the_batch_halves(trained, static):
    # Four rows: two stop at once (EOS), so the batch of 4 runs on with two masked rows
    # until the third finishes; the last runs alone.
    prompts = ["def add(", "print('h", "for i in range(10):\n", "z" * 20]
    got = generate(trained, TOKENIZER, prompts, max_new_tokens=60, drafter=HeadsDrafter(4),
                   compile=True)
    assert _ids(got) == _ids(generate(trained, TOKENIZER, prompts, max_new_tokens=60))
    batches = [shape[0] for shape in static]
    assert batches[0] == 4 and set(batches) <= {4, 2, 1} and batches[-1] < 4
    steps = [g.stats.forward_passes - 1 for g in got]  # the prefill is not a step
    assert batches.count(4) >= sorted(steps)[1]  # masked rows stayed until two were left


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_static_steps_replay_the_eager_draws(trained, trained_draft, static,
                                                     temperature):
    """Draws are inputs of the step: one seed gives one output, static or eager, also where
    the eager step cut a chain's padding (prompt lookup; with the draft model's q)."""
    sampling = SamplingConfig(temperature=temperature)
    for drafter in (None, HeadsDrafter(4), DrafterSpec(drafter="heads", tree="tree8"),
                    PromptLookup(num_draft=5),
                    Combined(DraftModel(trained_draft, TOKENIZER, 2), PromptLookup(num_draft=5))):
        runs = [generate(trained, TOKENIZER, PROMPTS[:1], max_new_tokens=30, drafter=drafter,
                         sampling=sampling, seed=3, compile=compile) for compile in (False, True)]
        assert _ids(runs[0]) == _ids(runs[1])


def _record_steps(monkeypatch, drafter):
    """Each step's real drafts per row, as proposed, and each verify forward's tokens per row."""
    proposed, forwards = [], []
    propose, hidden_states = drafter.propose, engine.hidden_states

    def spy_propose():
        drafts = propose()
        proposed.append(drafts.real().tolist())
        return drafts

    def spy_forward(model, tokens, *rest, **options):
        forwards.append(tokens.shape[1])
        return hidden_states(model, tokens, *rest, **options)

    monkeypatch.setattr(drafter, "propose", spy_propose)
    monkeypatch.setattr(engine, "hidden_states", spy_forward)
    return proposed, forwards


@pytest.mark.parametrize("name", ["prompt_lookup", "draft_model+prompt_lookup"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch6"])
def test_eager_chain_steps_verify_the_longest_real_proposal(trained, trained_draft, monkeypatch,
                                                           name, prompts):
    """Eagerly, a chain's step verifies the root and the batch's longest real proposal, not
    the padding: its width varies from step to step, and the output is still autoregressive
    decoding's."""
    drafter = {"prompt_lookup": PromptLookup(num_draft=6),
               "draft_model+prompt_lookup": Combined(DraftModel(trained_draft, TOKENIZER, 2),
                                                     PromptLookup(num_draft=6))}[name]
    reference = generate(trained, TOKENIZER, prompts, max_new_tokens=48, stop=["print"])
    proposed, forwards = _record_steps(monkeypatch, drafter)
    got = generate(trained, TOKENIZER, prompts, max_new_tokens=48, drafter=drafter,
                   stop=["print"])
    assert _ids(got) == _ids(reference)
    assert forwards == [1 + max(real) for real in proposed]
    assert len(set(forwards)) > 1 and max(forwards) == 7  # cut steps, and full ones
    if len(prompts) > 1:  # rows of one step with different numbers of real drafts
        assert any(len(set(real)) > 1 for real in proposed)
    assert sum(g.stats.nodes_verified for g in got) == \
        len(prompts) + sum(w * len(real) for w, real in zip(forwards, proposed))


def test_a_step_with_nothing_drafted_verifies_one_token_unless_compiled(trained, static,
                                                                        monkeypatch):
    """No prompt-lookup match (no 40-gram in a short context): every eager step is an
    autoregressive one; compiled, the step keeps its fixed width of num_draft + 1."""
    drafter = PromptLookup(num_draft=4, max_ngram=40, min_ngram=40)
    prompts = ["def add(", "for i"]
    reference = generate(trained, TOKENIZER, prompts, max_new_tokens=16)
    proposed, forwards = _record_steps(monkeypatch, drafter)
    eager = generate(trained, TOKENIZER, prompts, max_new_tokens=16, drafter=drafter)
    assert _ids(eager) == _ids(reference)
    assert proposed and all(max(real) == 0 for real in proposed)
    assert set(forwards) == {1}
    assert all(g.stats.nodes_per_forward == 1 for g in eager)
    forwards.clear()
    compiled = generate(trained, TOKENIZER, prompts, max_new_tokens=16, drafter=drafter,
                        compile=True)
    assert _ids(compiled) == _ids(reference)
    assert set(forwards) == {5} and {shape[1] for shape in static} == {5}


def test_rebuild_sizes():
    assert rebuild_size(8, 8, compiled=True) is None
    assert [rebuild_size(live, 8, compiled=True) for live in (7, 5, 4, 3, 2, 1)] == \
        [None, None, 4, 4, 2, 1]
    assert rebuild_size(3, 6, compiled=True) == 4 and rebuild_size(5, 6, compiled=True) is None
    assert rebuild_size(5, 8, compiled=False) == 5  # eagerly finished rows leave at once


def test_compiled_shapes_are_bounded(trained, static, monkeypatch):
    monkeypatch.setattr(engine, "MAX_SHAPES", 2)
    for size in (1, 2):
        generate(trained, TOKENIZER, PROMPTS[:size], max_new_tokens=4, compile=True)
    with pytest.raises(ValueError, match="compiled for 2 shapes .* compile=False"):
        generate(trained, TOKENIZER, PROMPTS[:3], max_new_tokens=4, compile=True)


def test_a_shape_counts_once_however_often_the_drafters_alternate(trained, static):
    # Stacked heads are rebuilt when k changes; the shape they give is still one per k.
    for k in (2, 3, 2, 3):
        generate(trained, TOKENIZER, PROMPTS[:1], max_new_tokens=8, drafter=HeadsDrafter(k),
                 compile=True)
    assert len(engine._compiled[False].shapes) == 2


def test_compile_without_support_is_a_one_line_error(tiny_config, monkeypatch):
    """compile=True on a torch that cannot compile says so before decoding, not mid-way."""
    model = MTPModel(tiny_config).eval()
    monkeypatch.setattr(engine, "_compiled", type(engine._compiled)())
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match=r"compile=True: torch.compile is not supported .* "
                                         r"compile=False"):
        generate(model, TOKENIZER, ["def f("], max_new_tokens=4, compile=True)


@pytest.mark.slow  # compiles the step for a few shapes: about a minute on 2 cores
def test_compiled_step_equals_the_eager_step(tiny_config):
    model = MTPModel(MTPConfig(**{**tiny_config.to_dict(), "max_seq_len": 128})).eval()
    prompts = ["def f(x):", "import os\nimport sys\n"]
    reference = generate(model, TOKENIZER, prompts, max_new_tokens=40, stop=["\n\n"])
    for drafter in (None, DrafterSpec(drafter="heads", tree=[[0], [1], [0, 0]])):
        got = generate(model, TOKENIZER, prompts, max_new_tokens=40, drafter=drafter,
                       stop=["\n\n"], compile=True)
        assert _ids(got) == _ids(reference)
        again = generate(model, TOKENIZER, prompts, max_new_tokens=40, drafter=drafter,
                         stop=["\n\n"], compile=True)  # compiled already: the same shapes
        assert _ids(again) == _ids(reference)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _part_at_near_ties(model, prompts, got, reference, share=0.02):
    """Each pair of greedy outputs agrees up to its first difference, and there the two tokens'
    logits (the model's forward over the common prefix) are within `share` of the logits'
    range: bfloat16 rounds differently in fused (compiled) and unfused kernels, and in a wide
    verify step than in a one-token step, which decides near-tied logits, nothing else."""
    for prompt, a, b in zip(prompts, _ids(got), _ids(reference)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if same is None:
            assert len(a) == len(b)
            continue
        ids = TOKENIZER.encode_prompt(prompt) + a[:same]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.output.weight.device),
                           heads=[0])[0, -1, 0].float()
        gap = (logits[a[same]] - logits[b[same]]).abs()
        assert gap <= share * (logits.max() - logits.min()), (prompt, same, gap)


@pytest.mark.gpu
@gpu
def test_bfloat16_cuda_graphs_decode_as_the_eager_step():
    """Compiled (CUDA graphs) and eager bfloat16 decoding, autoregressive and speculative,
    part only where bfloat16's rounding decides a near tie (the first H100 lease saw the
    compiled and eager outputs part at token 12 of a random model: bitwise equality is more
    than the arithmetic gives)."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=256, n_layers=4, n_heads=8, max_seq_len=512,
                       n_future=8)
    model = MTPModel(config).to("cuda", torch.bfloat16).eval()
    prompts = ["def fibonacci(n):", "class Stack:\n"]
    eager = generate(model, TOKENIZER, prompts, max_new_tokens=64)
    graphs = generate(model, TOKENIZER, prompts, max_new_tokens=64, compile=True)
    _part_at_near_ties(model, prompts, graphs, eager)
    for drafter in (HeadsDrafter(8), DrafterSpec(drafter="heads", tree="tree32")):
        _part_at_near_ties(model, prompts, generate(
            model, TOKENIZER, prompts, max_new_tokens=64, drafter=drafter), eager)
        _part_at_near_ties(model, prompts, generate(
            model, TOKENIZER, prompts, max_new_tokens=64, drafter=drafter, compile=True), graphs)


@pytest.mark.gpu
@gpu
def test_no_attention_plan_is_built_per_step_on_a_gpu():
    """cuDNN attention re-plans for every new key length (14 ms of CPU a call on an H100):
    decode steps must not call it, in bfloat16 or float32."""
    from torch.profiler import ProfilerActivity, profile

    config = MTPConfig(vocab_size=262, dim=128, n_layers=2, n_heads=4, max_seq_len=256,
                       n_future=4)
    for dtype in (torch.bfloat16, torch.float32):
        model = MTPModel(config).to("cuda", dtype).eval()
        generate(model, TOKENIZER, ["warm up"], max_new_tokens=8, drafter=HeadsDrafter(4))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(model, TOKENIZER, ["def f(x):"], max_new_tokens=32, drafter=HeadsDrafter(4))
        names = {event.key for event in prof.key_averages()}
        assert not [name for name in names if "cudnn" in name.lower() and "attention" in
                    name.lower()], dtype


def test_steps_hand_drafters_the_hidden_states_of_every_cached_token(trained):
    """`Verified.path_hidden()` holds the heads' hidden states at the tokens each forward added
    to the cache: the prompt after the prefill, then each kept path; together they are the
    hidden states of a plain forward over the whole text."""
    seen = []

    class Recorder(HeadsDrafter):
        def update(self, step):
            seen.append((step.path_hidden(), step.kept, step.new_ids))
            super().update(step)

    prompt = "def add("
    [g] = generate(trained, TOKENIZER, [prompt], max_new_tokens=20,
                   drafter=Recorder(4, DrafterSpec(drafter="heads", tree="tree8").build(
                       trained).tree))
    pieces = [hidden[0, :int(count[0])] for hidden, count, _ in seen]
    text = [TOKENIZER.eos_id, *TOKENIZER.encode(prompt), *g.token_ids]
    with torch.no_grad():
        full = torch.stack([trained.head(trained.trunk(torch.tensor([text])), i)
                            for i in range(4)], dim=2)[0]  # (T, 4, D)
    # Every token but the last root; the last step may keep drafts past the budget too.
    cached = torch.cat(pieces)
    assert cached.shape[0] >= len(text) - 1
    torch.testing.assert_close(cached[:len(text) - 1], full[:len(text) - 1])
