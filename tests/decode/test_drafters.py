"""Every drafter: greedy output equals autoregressive, ragged batches, the n-gram index, auto,
and bad input."""

import json
import random

import pytest
from decode.common import PROMPTS, TOKENIZER, check_greedy, ids_of

from mtp.generate import (Auto, Combined, DraftModel, DrafterSpec, HeadsDrafter, PromptLookup,
                          SamplingConfig, generate)
from mtp.tune import TuneCache
from mtp.decode.drafters.prompt_lookup import NgramIndex
from mtp.kv_cache import KVCache
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer


@pytest.fixture
def random_draft():
    config = MTPConfig(vocab_size=262, dim=16, n_layers=1, n_heads=2, max_seq_len=64)
    return MTPModel(config).double().eval()


def _drafters(draft_model):
    return {
        "prompt_lookup": PromptLookup(num_draft=5, max_ngram=3, min_ngram=1),
        "draft_model": DraftModel(draft_model, TOKENIZER, num_draft=3),
        "heads+prompt_lookup": Combined(HeadsDrafter(3), PromptLookup(num_draft=6)),
        "heads+draft_model": Combined(HeadsDrafter(2), DraftModel(draft_model, TOKENIZER, 4)),
    }


@pytest.mark.parametrize("name", ["prompt_lookup", "draft_model", "heads+prompt_lookup",
                                  "heads+draft_model"])
def test_greedy_equals_autoregressive_on_a_random_model(random_model, random_draft, name):
    check_greedy(random_model, _drafters(random_draft)[name], PROMPTS[:3], 24, alone=3)


@pytest.mark.parametrize("name", ["prompt_lookup", "draft_model", "heads+prompt_lookup",
                                  "heads+draft_model"])
def test_greedy_equals_autoregressive_on_a_trained_model(trained, trained_draft, name):
    reference = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40)
    drafter = _drafters(trained_draft)[name]
    generations = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40, drafter=drafter)
    assert ids_of(generations) == ids_of(reference)
    assert [g.finish_reason for g in generations] == [g.finish_reason for g in reference]
    # Drafts are accepted: the trained draft model agrees often; prompt lookup finds the
    # prompt's own n-grams in the recited loop body now and then.
    least = 1.0 if name == "prompt_lookup" else 1.5
    assert max(g.stats.tokens_per_forward for g in generations) > least
    for g in generations:
        assert g.stats.forward_passes <= g.stats.new_tokens


def test_stop_strings_and_budget_with_a_draft_model(trained, trained_draft):
    drafter = DraftModel(trained_draft, TOKENIZER, num_draft=4)
    for kwargs in ({"stop": ["return"]}, {"max_new_tokens": 5}):
        expected = generate(trained, TOKENIZER, ["def add("], **kwargs)
        got = generate(trained, TOKENIZER, ["def add("], drafter=drafter, **kwargs)
        assert ids_of(got) == ids_of(expected) and got[0].text == expected[0].text


def _plain_lookup(ids, num_draft, min_ngram, max_ngram):
    """The most recent earlier occurrence of the longest suffix n-gram, by scanning."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(ids) < n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + num_draft]
    return []


def test_ngram_index_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        low, high = rng.randrange(1, 4), rng.randrange(1, 6)
        low, high = min(low, high), max(low, high)
        index = NgramIndex(ids[:rng.randrange(len(ids) + 1)], low, high)
        index.extend(ids[len(index.ids):])
        assert index.lookup(5) == _plain_lookup(ids, 5, low, high), (ids, low, high)


def test_prompt_lookup_proposes_a_repeated_ngrams_continuation(random_model):
    drafter = PromptLookup(num_draft=4, max_ngram=3, min_ngram=2)
    prompt = TOKENIZER.encode("x = foo(bar)\ny = foo(")
    drafter.start(random_model, [prompt, TOKENIZER.encode("abc")],
                  KVCache(random_model.config, 2, 64), SamplingConfig(), None)
    drafts = drafter.propose()
    assert TOKENIZER.decode(drafts.tokens[0].tolist()) == "bar)"
    assert drafts.lengths.tolist() == [4, 0]  # "bc" never occurred before: nothing proposed
    drafter.keep([1])
    drafts = drafter.propose()
    assert drafts.count == 4 and drafts.lengths.tolist() == [0]  # padded: a fixed shape


def test_auto_keeps_the_fastest_and_caches_it(random_model, tmp_path):
    cache = TuneCache(tmp_path / "tune.json")
    auto = Auto(tokens=8, model_id="a checkpoint", cache=cache)
    reference = generate(random_model, TOKENIZER, PROMPTS[:2], max_new_tokens=12)
    chosen = auto.choose(random_model, TOKENIZER, PROMPTS[:2], sampling=SamplingConfig(),
                         max_new_tokens=12)
    got = generate(random_model, TOKENIZER, PROMPTS[:2], max_new_tokens=12, drafter=chosen)
    assert ids_of(got) == ids_of(reference)
    measured = auto.record.figures
    assert auto.choice in measured and auto.record.unit == "tokens/s"
    assert measured["autoregressive"] > 0 and "heads(k=4)" in measured
    assert "heads(k=4)+prompt_lookup(num_draft=8, max_ngram=4, min_ngram=2)" in measured \
        or any(label.endswith("+prompt_lookup(num_draft=8, max_ngram=4, min_ngram=2)")
               for label in measured)  # the fastest chain with prompt lookup
    best = max(measured, key=measured.get)
    if auto.choice != "autoregressive":  # a drafter wins only by the margin over AR
        assert auto.choice == best
        assert measured[best] >= auto.margin * measured["autoregressive"]
    [entry] = json.loads(cache.path.read_text()).values()
    assert entry["choice"] == auto.choice and entry["step"] == "drafter"
    # Another process (an empty in-memory cache) reads the file instead of measuring again.
    fresh = Auto(tokens=8, model_id="a checkpoint", cache=TuneCache(cache.path))
    fresh._measure = lambda *args: pytest.fail("measured again")
    clone = MTPModel(random_model.config).double().eval()
    clone.load_state_dict(random_model.state_dict())
    again = fresh.choose(clone, TOKENIZER, PROMPTS[:2], sampling=SamplingConfig(),
                         max_new_tokens=4)
    assert fresh.choice == auto.choice and fresh.record.how == "cached"
    assert repr(again) == repr(chosen)


def test_auto_measures_in_the_callers_batches_and_times_the_leaders_twice(random_model,
                                                                         monkeypatch):
    import mtp.generate.measure as measure_module  # auto times through the one harness

    timed = []  # (drafter, prompts) of every timed generate call (warm-ups are 2 tokens)
    real = measure_module.generate

    def spy(model, tokenizer, prompts, **options):
        if options["max_new_tokens"] != 2:
            timed.append((repr(options["drafter"]), len(prompts)))
        return real(model, tokenizer, prompts, **options)

    monkeypatch.setattr(measure_module, "generate", spy)
    auto = Auto(tokens=4, finalists=2)
    auto.choose(random_model, TOKENIZER, PROMPTS[:3], sampling=SamplingConfig(),
                max_new_tokens=4, batch_size=1)
    assert {size for _, size in timed} == {1}  # three prompts, one at a time
    runs = {label: [d for d, _ in timed].count(label) for label, _ in timed}
    assert set(runs.values()) == {3, 6}  # once or twice over the three prompts
    twice = {label for label, count in runs.items() if count == 6}
    assert "None" in twice and 2 <= len(twice) <= 3  # autoregressive and the 2 leaders
    assert len(runs) == len(auto.record.figures)


def check_k_auto_measures_the_heads_only(model, kind):
    """k=auto measures the chains of heads alone and picks one (a `kind`) or none; also asked
    of sequential modules (tests/decode/drafters/test_sequential.py)."""
    auto = Auto(spec=DrafterSpec(k="auto"), tokens=4)
    drafter = auto.choose(model, TOKENIZER, PROMPTS[:1], sampling=SamplingConfig(),
                          max_new_tokens=4)
    assert set(auto.record.figures) == {"autoregressive", "heads(k=2)", "heads(k=3)",
                                        "heads(k=4)"}
    assert drafter is None or isinstance(drafter, kind)


def test_k_auto_measures_the_heads_only(random_model):
    check_k_auto_measures_the_heads_only(random_model, HeadsDrafter)


def test_draft_model_with_another_tokenizer_is_refused_before_decoding(random_model,
                                                                       random_draft):
    other = BPETokenizer.train(["def f(x): return x"] * 4, vocab_size=262)
    with pytest.raises(ValueError, match="tokenizer .* differs from the target's"):
        generate(random_model, TOKENIZER, ["x"], drafter=DraftModel(random_draft, other))


@pytest.mark.parametrize("make, message", [
    (lambda: PromptLookup(min_ngram=0), "min_ngram=0 must be a positive integer"),
    (lambda: PromptLookup(max_ngram=0), "max_ngram=0 must be a positive integer"),
    (lambda: PromptLookup(max_ngram=2, min_ngram=3), "max_ngram=2 must be >= min_ngram=3"),
    (lambda: PromptLookup(num_draft=0), "num_draft=0 must be a positive integer"),
    (lambda: HeadsDrafter(1), "k=1 must be an integer >= 2"),
])
def test_bad_drafter_sizes(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("drafter, message", [
    ("medusa", "unknown drafter 'medusa': choose one of auto, autoregressive, heads, "
               "prompt_lookup"),
    ("draft_model", "needs draft_model=PATH"),
    (HeadsDrafter(5), "k from 2 to n_future=4, got k=5"),
    (3, "drafter must be a Drafter, a DrafterSpec, a name or None, got 3"),
])
def test_bad_drafter_arguments(random_model, drafter, message):
    with pytest.raises(ValueError, match=message):
        generate(random_model, TOKENIZER, ["x"], drafter=drafter)
