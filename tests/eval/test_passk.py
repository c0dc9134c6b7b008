import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtp.eval.passk import check_ks, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),
        (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2) / C(10,2)
        (10, 3, 10, 1.0),
        (4, 2, 3, 1.0),  # n - c < k: every draw holds a correct sample
        (10, 0, 5, 0.0),
        (1, 1, 1, 1.0),
        (200, 1, 100, 0.5),
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(n=st.integers(1, 60), data=st.data())
def test_pass_at_k_equals_binomial_form(n: int, data: st.DataObject) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-9)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 4, 1), (3, 1, 0)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="n=3"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_averages_problems() -> None:
    result = mean_pass_at_k({"a": (5, 2), "b": (5, 0), "c": (5, 5)}, [1, 5])
    assert result == pytest.approx({1: (0.4 + 0 + 1) / 3, 5: 2 / 3})


def test_k_above_fewest_samples_is_an_error_not_a_skip() -> None:
    with pytest.raises(ValueError, match=r"k=\[1, 10\].*1\.\.4"):
        mean_pass_at_k({"a": (10, 1), "b": (4, 1)}, [1, 10])
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k({}, [1])
    with pytest.raises(ValueError, match=r"k=\[\]"):
        check_ks([], 3)
