import math

import pytest
import torch

from mtp.decode.sampling import SamplingConfig, exponential, probabilities, sample


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0, got nan"),
    ({"top_k": 0}, "top_k must be None or an integer >= 1, got 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_greedy_is_one_hot_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    probs = probabilities(logits, SamplingConfig(temperature=0))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert sample(probs, exponential(probs.shape, None, "cpu")).tolist() == [1, 0]


def test_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    torch.testing.assert_close(probabilities(logits, SamplingConfig(temperature=1.0)),
                               torch.tensor([0.5, 0.25, 0.15, 0.1]))
    hot = probabilities(logits, SamplingConfig(temperature=2.0))
    torch.testing.assert_close(hot, (logits / 2).softmax(-1))
    top2 = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed and the fourth is not.
    nucleus = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(nucleus, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9)
    tiny = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(tiny, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_sample_draws_from_the_distribution_even_unnormalised():
    weights = torch.tensor([3.0, 0.0, 1.0, 6.0]).expand(40_000, 4)  # sums to 10
    draws = sample(weights, exponential(weights.shape, torch.Generator().manual_seed(0), "cpu"))
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.3, 0.0, 0.1, 0.6], dtype=torch.float64),
                               atol=0.01, rtol=0)


def test_bf16_logits_give_float32_probabilities():
    probs = probabilities(torch.randn(2, 5, dtype=torch.bfloat16), SamplingConfig(temperature=1))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
