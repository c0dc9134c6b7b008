"""The outputs' figures: the share of repeated n-grams."""


def test_repeated_share():
    from mtp.decode.output import repeated_share, repetition

    assert repeated_share([1, 2, 3, 4, 5, 6], 2) == 0.0
    assert repeated_share([7, 7, 7, 7], 2) == 0.75  # (7, 7) again at 1 and 2: 1..3
    assert repeated_share([1, 2, 3, 9, 1, 2, 3], 3) == 3 / 7
    # pooled by length: 3 of 7 tokens, then 0 of 3; an output shorter than n repeats nothing
    assert repetition([[1, 2, 3, 9, 1, 2, 3], [4, 5, 6], [8]], 3) == 3 / 11
