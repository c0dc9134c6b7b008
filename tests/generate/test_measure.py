"""measure_decoding: every k and tree through generate, on held-out prompts that fit; and the
one generate-and-time loop (time_generate, time_calls) that it and every benchmark use."""

import pytest

from mtp.generate import HeadsDrafter, SamplingConfig, generate
from mtp.generate.measure import format_decoding, measure_decoding, time_calls, time_generate
from mtp.model import MTPConfig, MTPModel
from mtp.train.summary import decode_prompts, held_out_prompts
from mtp.tokenizers import ByteTokenizer
from mtp.train.run import compose, model_config
from mtp.train.settings import check_settings
from conftest import DOCS  # tests/ is on the path


def test_heads_that_learnt_the_text_accept_drafts_at_every_k(trained: MTPModel) -> None:
    prompts = [doc[:8] for doc in DOCS]
    figures = measure_decoding(trained, ByteTokenizer(), prompts, max_new_tokens=24,
                               trees=["tree8", "tree16"])
    tpf = figures["tokens_per_forward"]
    assert list(tpf) == [1, 2, 3, 4] and tpf[1] == 1.0 and figures["speedup"][1] == 1.0
    assert tpf[4] > 2.0 and all(1.0 <= tpf[k] <= k for k in tpf)
    assert set(figures["trees"]) == {"tree8", "tree16"}
    assert figures["tree"] == max(figures["trees"], key=figures["trees"].get)
    assert figures["tree_tokens_per_forward"] == figures["trees"][figures["tree"]] > 1.0
    assert figures["identical"] is True  # greedy speculative == autoregressive, every k/tree
    assert 0.0 <= figures["repeated"] <= 1.0 and figures["device"] == "cpu"
    assert (figures["prompts"], figures["max_new_tokens"], figures["batch_size"]) == (3, 24, 1)
    lines = format_decoding(figures)
    assert lines[1].split() == ["k", "tok/fwd", "speed-up"] and len(lines) == 2 + 4 + 1 + 1
    # the last line says which configuration pays, or plainly that none does
    speedups = {f"k={k}": x for k, x in figures["speedup"].items() if k > 1}
    speedups[f"tree {figures['tree']}"] = figures["tree_speedup"]
    best = max(speedups, key=speedups.get)
    assert lines[-1].startswith("best: " if speedups[best] > 1 else "none pays: ")
    assert best in lines[-1] and f"{speedups[best]:.2f}x" in lines[-1]


def test_the_verdict_says_plainly_when_no_configuration_pays() -> None:
    figures = {"prompts": 2, "max_new_tokens": 8, "batch_size": 1, "device": "cpu",
               "repeated": 0.1, "tokens_per_forward": {1: 1.0, 2: 1.4, 4: 1.5},
               "speedup": {1: 1.0, 2: 0.85, 4: 0.7}, "tree": "tree8",
               "tree_tokens_per_forward": 1.6, "tree_speedup": 0.8, "identical": True}
    assert format_decoding(figures)[-1] == (
        "none pays: every k and tree is slower than autoregressive decoding here (best k=2, "
        "0.85x); decode with drafter=autoregressive, or drafter=auto to measure the other "
        "drafters")
    figures["tree_speedup"] = 1.31
    assert format_decoding(figures)[-1] == \
        "best: tree tree8, 1.31x autoregressive decoding (identical ids)"
    figures["repeated"] = 0.98  # an undertrained model's loop: said, so nobody quotes it
    assert format_decoding(figures)[-1].endswith(
        "(identical ids) (on text that is 98% repetition: a loop, not a figure to quote)")


def test_time_generate_decodes_as_generate_does_batch_by_batch(trained: MTPModel) -> None:
    tokenizer, prompts = ByteTokenizer(), [doc[:8] for doc in DOCS]
    timed = time_generate(trained, tokenizer, prompts, max_new_tokens=12, batch_size=2,
                          warmup_tokens=2, drafter=HeadsDrafter(4))
    alone = generate(trained, tokenizer, prompts, max_new_tokens=12)
    assert timed.token_ids == [g.token_ids for g in alone]  # greedy: lossless, any batching
    assert timed.stats.new_tokens == sum(len(ids) for ids in timed.token_ids)
    assert timed.stats.tokens_per_forward > 1.0
    assert timed.seconds > 0 and timed.tokens_per_second == pytest.approx(
        timed.stats.new_tokens / timed.seconds)
    # seed_per_batch: batch i is seeded seed + i, so each prompt decodes as its own call would
    sampling = SamplingConfig(temperature=1.0)
    timed = time_generate(trained, tokenizer, prompts, max_new_tokens=6, seed=5,
                          seed_per_batch=True, sampling=sampling)
    assert timed.token_ids == [generate(trained, tokenizer, [p], max_new_tokens=6, seed=5 + i,
                                        sampling=sampling)[0].token_ids
                               for i, p in enumerate(prompts)]
    with pytest.raises(ValueError, match="at least one prompt"):
        time_generate(trained, tokenizer, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="batch_size=0"):
        time_generate(trained, tokenizer, prompts, max_new_tokens=4, batch_size=0)


def test_time_calls_times_each_batch_and_keeps_the_order() -> None:
    calls = []

    def decode(start: int, batch: list[int]) -> list[int]:
        calls.append((start, batch))
        return [x * 10 for x in batch]

    seconds, results = time_calls(decode, [1, 2, 3, 4, 5], 2)
    assert calls == [(0, [1, 2]), (2, [3, 4]), (4, [5])]
    assert results == [10, 20, 30, 40, 50] and seconds >= 0


def test_a_one_head_model_measures_autoregressive_decoding_only() -> None:
    model = MTPModel(MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=64))
    figures = measure_decoding(model.eval(), ByteTokenizer(), ["def f("], max_new_tokens=4,
                               trees=["tree8"])
    assert figures["tokens_per_forward"] == {1: 1.0} and figures["tree"] is None
    assert figures["trees"] == {} and "tree" not in format_decoding(figures)[-1]


@pytest.mark.parametrize(("override", "message"), [
    ("decode.prompts=0", r"decode\.prompts=0 must be a positive integer"),
    ("decode.max_new_tokens=512", r"decode\.max_new_tokens=512 leaves no room .*=512"),
    ("decode.trees=[auto:16]", r"'auto:16' needs a calibration"),
    ("decode.trees=[tree9]", r"tree9"),
    ("decode.trees=tree8", r"decode\.trees='tree8' must be a list"),  # typed
    ("+decode.k=4", r"decode\.k is not a setting"),
])
def test_decode_settings_that_cannot_work_are_named_before_training(override: str,
                                                                    message: str) -> None:
    cfg = compose(["+experiment=byte8", "model=tiny", "run_dir=/tmp/unused", override])
    config = model_config(cfg, ByteTokenizer())
    with pytest.raises(ValueError, match=message):
        decode_prompts(check_settings(cfg).decode, config, ByteTokenizer())


def test_the_run_decodes_the_prompts_that_fit_or_none() -> None:
    cfg = compose(["+experiment=byte8", "model=tiny", "run_dir=/tmp/unused"])
    config = model_config(cfg, ByteTokenizer())  # a context of 512 bytes
    decode = check_settings(cfg).decode
    assert len(decode_prompts(decode, config, ByteTokenizer())) == cfg.decode.prompts
    small = MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=128)
    assert decode_prompts(decode, small, ByteTokenizer()) == []
    off = check_settings(compose(["decode.enabled=false", "run_dir=/x"])).decode
    assert decode_prompts(off, config, ByteTokenizer()) == []


def test_held_out_prompts_are_humaneval_prompts_that_leave_room() -> None:
    tokenizer = ByteTokenizer()
    prompts = held_out_prompts(tokenizer, 5, max_seq_len=400, max_new_tokens=64)
    assert len(prompts) == 5 and all(len(p.encode()) + 1 + 64 <= 400 for p in prompts)
    assert all('"""' in p or "'''" in p for p in prompts)  # a docstring to complete
    assert held_out_prompts(tokenizer, 5, max_seq_len=65, max_new_tokens=64) == []
    with pytest.raises(ValueError, match="at least one prompt"):
        measure_decoding(MTPModel(MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4)),
                         tokenizer, [], max_new_tokens=4)


def test_the_decode_dtype_is_the_faster_at_the_steps_width(monkeypatch, tmp_path) -> None:
    """dtype=auto on a CPU: bfloat16 only where it measured faster at the drafter's width."""
    import torch

    import mtp.generate.measure as measure
    import mtp.generate.choices as choices
    from mtp.tune import TuneCache

    model = MTPModel(MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=64,
                               n_future=4)).eval()
    weights = {n: p.clone() for n, p in model.state_dict().items()}
    assert measure.step_width(None) == 1 and measure.step_width(HeadsDrafter(4)) == 4  # k = 4: 3 drafts
    widths = []

    def timed(at: MTPModel, width: int, batch: int) -> float:
        widths.append(width)
        faster = bf16_faster_from <= width
        return 1.0 if (next(at.parameters()).dtype == torch.bfloat16) == faster else 2.0

    monkeypatch.setattr(choices, "plain_forward_seconds", timed)
    monkeypatch.setattr(choices, "cpu_has_bf16", lambda: True)
    bf16_faster_from = 8
    variants = choices.DtypeVariants(model, measure=True, cache=TuneCache(tmp_path / "t.json"))
    one = variants.choose(1, 1)
    assert one.value == "float32" and widths == [1, 1]
    assert all(torch.equal(p, weights[n]) for n, p in model.state_dict().items())  # untouched
    assert one.describe() == (f"dtype: float32 (measured in {one.seconds:.1f} s, a forward of "
                              f"1 tokens; ms: float32 1000, bfloat16 2000)")
    wide = variants.choose(9, 1)
    assert wide.value == "bfloat16" and widths == [1, 1, 9, 9]
    assert next(variants.model("bfloat16").parameters()).dtype == torch.bfloat16
    assert variants.choose(9, 1).how == "cached" and widths == [1, 1, 9, 9]
    monkeypatch.setattr(choices, "cpu_has_bf16", lambda: False)  # bf16 emulated: float32
    plain = choices.DtypeVariants(MTPModel(model.config).eval(), measure=True, cache=None)
    assert plain.choose(9, 1).describe() == "dtype: float32 (fixed: this CPU has no bf16 " \
                                            "arithmetic)"
    named = choices.DtypeVariants(model, measure=False, cache=None)
    assert named.choose(9, 1).how == "fixed" and widths == [1, 1, 9, 9]


def test_bfloat16_decodes_as_its_autoregressive_output_up_to_near_ties(trained) -> None:
    """In bfloat16 a wide verify step rounds differently from a one-token step; greedy
    speculative output then parts from autoregressive output only at a near tie."""
    import copy

    import torch

    from decode.test_engine import _part_at_near_ties
    from mtp.generate import PromptLookup

    model = copy.deepcopy(trained).to(torch.bfloat16)
    prompts = [doc[:8] for doc in DOCS]
    reference = generate(model, ByteTokenizer(), prompts, max_new_tokens=32)
    for drafter in (HeadsDrafter(4), PromptLookup(num_draft=4)):
        got = generate(model, ByteTokenizer(), prompts, max_new_tokens=32, drafter=drafter)
        _part_at_near_ties(model, prompts, got, reference)
