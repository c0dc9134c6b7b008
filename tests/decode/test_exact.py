"""Exact mode: every drafter's greedy ids equal the exact reference's bit for bit, in float32
and bfloat16, alone and in ragged batches, on trained models and on a model whose every choice
is a near tie; sampling with a seed gives the reference's draws; bad settings are refused
before decoding.

Every test runs twice: on the compiled kernels (`mtp.kernels`), where the reference is plain
autoregressive decoding, `generate(drafter=None)`, and a prompt's ids do not depend on its
batch; and through torch (MTP_KERNELS=off), where it is `generate(drafter=None, exact=True,
width=W)`, the same batch's. Where the kernels do not build, the first run is skipped."""

import copy

import pytest
import torch

from mtp.decode.tree import DynamicTree, Tree
from mtp.generate import (Combined, DecodeSettings, DraftModel, HeadsDrafter, LayerSkip,
                          Lookahead, PromptLookup, SamplingConfig, SequentialDrafter, generate,
                          open_decoder)
from mtp import kernels
from mtp.model import MTPModel, decodes_on_kernels
from mtp.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()
# Ragged: three lengths, and rows that stop at different steps (EOS, the stop string, the
# budget).
PROMPTS = ["def add(", "print('h", "for i in range(10):\n    print(i)\nfor", "zz"]
DTYPES = [torch.float32, torch.bfloat16]
TREE = Tree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)), name="five")


@pytest.fixture(autouse=True, params=["kernels", "torch"])
def decode_path(request, monkeypatch):
    """Each test on the kernels, and through torch."""
    if request.param == "torch":
        monkeypatch.setenv("MTP_KERNELS", "off")
    elif not kernels.active():
        pytest.skip(f"no compiled kernels here: {kernels.status().reason}")
    return request.param


def _reference_options(model: MTPModel, options: dict) -> dict:
    """The reference of an exact call with `options`: on the kernels plain decoding (seeded
    sampling: exact mode's draws, by position), else exact mode at the call's width."""
    if not decodes_on_kernels(model):
        return options
    sampling = options.get("sampling")
    exact = sampling is not None and not sampling.greedy
    return {**{k: v for k, v in options.items() if k not in ("width", "exact")},
            "exact": exact}


def _ids(generations):
    return [g.token_ids for g in generations]


def _in(model: MTPModel, dtype: torch.dtype) -> MTPModel:
    return copy.deepcopy(model).to(dtype)


def _drafters(draft: MTPModel):
    return {
        "heads": HeadsDrafter(4), "heads_tree": HeadsDrafter(4, TREE),
        "prompt_lookup": PromptLookup(num_draft=5),
        "draft_model": DraftModel(draft, TOKENIZER, num_draft=3),
        "layer_skip": LayerSkip([1], 3, threshold=0.3), "lookahead": Lookahead(4, 3, 2),
        "heads+prompt_lookup": Combined(HeadsDrafter(3), PromptLookup(num_draft=4)),
        "heads_dynamic": HeadsDrafter(4, DynamicTree.of(8, 3, 4)),
    }


def _check(model: MTPModel, drafter, prompts=PROMPTS, *, width=None, **options):
    """The drafter's ids in exact mode, in a batch and alone, against the reference's."""
    width = width or drafter.tree.n_nodes
    kwargs = dict(max_new_tokens=40, stop=["print"], exact=True, width=width, **options)
    reference = generate(model, TOKENIZER, prompts, **_reference_options(model, kwargs))
    got = generate(model, TOKENIZER, prompts, drafter=drafter, **kwargs)
    assert _ids(got) == _ids(reference)
    assert [g.finish_reason for g in got] == [g.finish_reason for g in reference]
    on_kernels = decodes_on_kernels(model)
    for index, prompt in enumerate(prompts):  # alone: its own reference, a batch of 1
        [alone] = generate(model, TOKENIZER, [prompt], drafter=drafter, **kwargs)
        [single] = generate(model, TOKENIZER, [prompt], **_reference_options(model, kwargs))
        assert alone.token_ids == single.token_ids
        if on_kernels and "seed" not in options:  # and what it was in the batch (greedy: a
            # seed draws by a row's place in its call)
            assert alone.token_ids == got[index].token_ids
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["heads", "heads_tree", "prompt_lookup", "draft_model",
                                  "layer_skip", "lookahead", "heads+prompt_lookup",
                                  "heads_dynamic"])
def test_every_drafter_gives_the_references_ids(trained, trained_draft, name, dtype):
    model = _in(trained, dtype)
    drafter = _drafters(_in(trained_draft, dtype))[name]
    got = _check(model, drafter)
    # The trained model keeps drafts: these steps accepted and compacted paths.
    if name in ("heads", "heads_tree", "draft_model", "layer_skip", "heads_dynamic"):
        assert max(g.stats.tokens_per_forward for g in got) > 1.5


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_sequential_modules_give_the_references_ids(trained_sequential, dtype, tree):
    _check(_in(trained_sequential, dtype), SequentialDrafter(4, tree))


def test_a_wider_step_than_the_drafters_pads_it(trained):
    model = _in(trained, torch.bfloat16)
    for drafter in (HeadsDrafter(3), HeadsDrafter(4, TREE), PromptLookup(num_draft=2)):
        _check(model, drafter, width=8)


def _near_ties(model: MTPModel, dtype: torch.dtype) -> MTPModel:
    """`model` in `dtype` with every choice a near tie: each even token's unembedding row
    copied, one unit in the last place up, to the odd token after it. Which of a pair wins is
    decided by the last bits of the hidden state, so any difference in a step's rounding
    shows."""
    model = _in(model, dtype)
    with torch.no_grad():
        weight = model.output.weight
        weight[1::2] = torch.nextafter(weight[0::2], torch.full_like(weight[0::2], torch.inf))
    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_near_ties_keep_the_references_ids(trained, trained_draft, dtype):
    model = _near_ties(trained, dtype)
    for drafter in (HeadsDrafter(4), HeadsDrafter(4, TREE), PromptLookup(num_draft=5),
                    DraftModel(_in(trained_draft, dtype), TOKENIZER, num_draft=3)):
        _check(model, drafter)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_on_the_kernels_every_step_is_exact_and_batch_blind(trained, dtype, decode_path):
    """On the kernels a prompt's ids are the same decoded alone or among others (ragged, some
    finishing early), and the plain speculative step, exact=False, gives them too."""
    if decode_path == "torch":
        pytest.skip("through torch a row's products round by how many rows its step has")
    model = _near_ties(trained, dtype)
    options = dict(max_new_tokens=40, stop=["print"])
    batch = _ids(generate(model, TOKENIZER, PROMPTS, **options))
    alone = [_ids(generate(model, TOKENIZER, [prompt], **options))[0] for prompt in PROMPTS]
    assert alone == batch
    for drafter in (HeadsDrafter(4), HeadsDrafter(4, TREE), PromptLookup(num_draft=5)):
        assert _ids(generate(model, TOKENIZER, PROMPTS, drafter=drafter, **options)) == batch


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_without_exact_mode_near_ties_part_from_width_1_decoding(trained, dtype, decode_path):
    """What the tests above guard against: on a CPU whose products round a row by how many
    rows its step has (float32 on the Intel and AMD CPUs of this project), the non-exact step
    parts from width-1 decoding at these near ties; where a CPU rounds every width alike
    (bfloat16 on an Intel Xeon with AVX512-BF16) there is nothing to show."""
    if decode_path == "kernels":
        pytest.skip("the kernels round a row alike at every step width (the test above)")
    model = _near_ties(trained, dtype)
    width_1 = _ids(generate(model, TOKENIZER, PROMPTS, max_new_tokens=40))
    parted = [_ids(generate(model, TOKENIZER, PROMPTS, max_new_tokens=40, drafter=drafter))
              != width_1 for drafter in (HeadsDrafter(4), HeadsDrafter(4, TREE))]
    if not any(parted):
        pytest.skip("this CPU rounds a row alike at every step width: nothing parts here")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["heads", "heads_tree", "prompt_lookup", "draft_model",
                                  "heads_dynamic"])
def test_sampling_with_a_seed_gives_the_references_draws(trained, trained_draft, name,
                                                         dtype):
    model = _in(trained, dtype)
    drafter = _drafters(_in(trained_draft, dtype))[name]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    got = _check(model, drafter, sampling=sampling, seed=7)
    other = generate(model, TOKENIZER, PROMPTS, max_new_tokens=40, stop=["print"], exact=True,
                     width=drafter.tree.n_nodes, sampling=sampling, seed=8)
    assert _ids(other) != _ids(got)  # the seed matters: these are draws, not the argmax


def test_exact_sampling_draws_from_the_target_distribution():
    """Each position's token is an inverse-CDF draw with its own uniform: over many seeds
    the first token follows head 0's distribution."""
    from mtp.decode.sampling import inverse_cdf, position_uniforms

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    uniforms = torch.cat([position_uniforms(seed, [0], [[5]], "cpu")[:, 0]
                          for seed in range(20_000)])
    tokens = inverse_cdf(probs.expand(len(uniforms), 4), uniforms)
    share = torch.bincount(tokens, minlength=4).double() / len(tokens)
    torch.testing.assert_close(share, probs, atol=0.01, rtol=0)
    assert inverse_cdf(torch.tensor([0.0, 1.0, 0.0]), torch.tensor(0.999)).item() == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"width": 4}, "width=4 sizes exact mode's steps: give exact=True with it"),
    ({"exact": True, "width": 2, "drafter": HeadsDrafter(4)},
     r"width=2 is below heads\(k=4\)'s widest step of 4 tokens"),
    ({"exact": True, "acceptance": "typical"}, "acceptance=typical is a rule of its own"),
    ({"exact": "yes"}, "exact='yes' must be true or false"),
    ({"exact": True, "width": 0}, "width=0 must be a positive integer"),
])
def test_bad_exact_settings_are_refused_before_decoding(trained, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(trained, TOKENIZER, ["x"], max_new_tokens=2, **kwargs)


def test_decode_settings_check_exact_mode_once():
    with pytest.raises(ValueError, match="width=4 sizes exact mode's steps"):
        DecodeSettings(width=4)
    with pytest.raises(ValueError, match="acceptance=typical is a rule of its own"):
        DecodeSettings(exact=True, acceptance="typical")
    settings = DecodeSettings(exact=True, width=8, drafter="heads")
    assert settings.step_width(HeadsDrafter(4)) == 8
    assert settings.generate_options(None)["width"] == 8
    with pytest.raises(ValueError, match="exact must be true, false or auto, got 'maybe'"):
        DecodeSettings(exact="maybe")
    auto = DecodeSettings(exact="auto", width=8)  # a width for exact mode, if it is chosen
    assert auto.step_width(HeadsDrafter(4)) == 4 and not auto.generate_options(None)["exact"]


def test_exact_auto_is_a_measured_choice_the_decoder_decodes_with(trained, tmp_path,
                                                                   decode_path):
    """exact=auto (the command lines' default) times both steps, records the choice, caches
    it, and the decoder decodes as chosen (on the kernels it is on, unmeasured: the steps
    are the same); a rule of its own keeps exact mode off."""
    from mtp.tune import TuneCache

    trained = _in(trained, torch.float32)  # a dtype the kernels take
    cache = TuneCache(tmp_path / "tune.json")
    settings = DecodeSettings(drafter="heads", options={"k": 4}, exact="auto", threads=1)
    decoder = open_decoder(None, settings, loaded=(trained, TOKENIZER), prompts=PROMPTS[:1],
                           cache=cache)
    [record] = [r for r in decoder.records if r.step == "exact"]
    [kernels_record] = [r for r in decoder.records if r.step == "kernels"]
    assert kernels_record.value is (decode_path == "kernels")
    assert decoder.settings.exact is record.value
    again = open_decoder(None, settings, loaded=(trained, TOKENIZER), prompts=PROMPTS[:1],
                         cache=cache)
    if decode_path == "kernels":
        assert (record.how, record.value) == ("fixed", True)
    else:
        assert record.how == "measured" and set(record.figures) == {"plain", "exact"}
        assert [r.how for r in again.records if r.step == "exact"] == ["cached"]
    [ids] = _ids(decoder.generate(PROMPTS[:1], max_new_tokens=20))
    width = {"width": 4} if record.value else {}
    assert ids == _ids(generate(trained, TOKENIZER, PROMPTS[:1], max_new_tokens=20,
                                exact=record.value, **width))[0]
    typical = open_decoder(None, DecodeSettings(drafter="heads", exact="auto", threads=1,
                                                acceptance="typical"),
                           loaded=(trained, TOKENIZER), cache=cache)
    assert [(r.how, r.value) for r in typical.records if r.step == "exact"] == [("fixed", False)]


@pytest.mark.slow  # two compilations, about 40 s on 2 cores: the tree's step (a chain's
def test_the_compiled_exact_step_gives_the_references_ids(trained):  # is its special case)
    model = _in(trained, torch.float32)
    for drafter in (HeadsDrafter(4, TREE),):
        reference = _ids(generate(model, TOKENIZER, PROMPTS[:2], max_new_tokens=24, exact=True,
                              width=drafter.tree.n_nodes, compile=True))
        got = generate(model, TOKENIZER, PROMPTS[:2], max_new_tokens=24, drafter=drafter,
                       exact=True, compile=True)
        assert _ids(got) == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "cuda_graphs"])
def test_on_a_gpu_every_drafter_gives_the_references_ids(trained, trained_draft, compile):
    """The same guarantee on CUDA in bfloat16, eager and with CUDA graphs: the step's shapes
    are fixed, so each kernel sees one shape for the whole call."""
    model = _in(trained, torch.bfloat16).cuda()
    draft = _in(trained_draft, torch.bfloat16).cuda()
    for name in ("heads", "heads_tree", "prompt_lookup", "draft_model", "heads_dynamic"):
        drafter = _drafters(draft)[name]
        _check(model, drafter, PROMPTS[:3], compile=compile)
