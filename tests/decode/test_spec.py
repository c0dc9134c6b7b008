"""DrafterSpec: each option is checked against the drafters it sizes, and a spec builds the
drafter it names."""

import pytest

from mtp.generate import DrafterSpec


@pytest.mark.parametrize("options, message", [
    ({"drafter": "ngram"}, "unknown drafter 'ngram': choose one of"),
    ({"drafter": "draft_model"}, "needs draft_model=PATH"),
    ({"drafter": "heads", "max_ngram": 3}, r"max_ngram=3 sizes prompt_lookup or "
                                           r"heads\+prompt_lookup, not drafter='heads'"),
    ({"drafter": "prompt_lookup", "k": 2}, r"k=2 sizes heads or heads\+prompt_lookup, not"),
    ({"drafter": "lookahead", "num_draft": 2}, "num_draft=2 sizes prompt_lookup"),
    ({"drafter": "heads", "k": 0}, "k must be an integer >= 1, 'auto' or None"),
    ({"drafter": "heads", "k": [1, 10]}, r"k must be an integer >= 1, 'auto' or None .* got \[1, 10\]"),
    ({"drafter": "prompt_lookup", "window": 3}, "window=3 sizes lookahead, not"),
    ({"drafter": "heads+prompt_lookup", "k": 1}, "needs k >= 2"),
    ({"drafter": "heads", "k": "auto", "tree": "tree8"}, "k='auto' measures chains"),
])
def test_drafter_spec_errors_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        DrafterSpec(**options)


def test_drafter_specs_build_the_drafter_they_name(random_model):
    lookup = DrafterSpec(drafter="prompt_lookup", num_draft=3, max_ngram=5).build(random_model)
    assert (lookup.num_draft, lookup.max_ngram, lookup.min_ngram) == (3, 5, 2)
    assert DrafterSpec(drafter="auto", k=1).build(random_model) is None  # k alone: the heads
    assert DrafterSpec(drafter="autoregressive").build(random_model) is None
    assert repr(DrafterSpec(drafter="heads", k=3).build(random_model)) == "heads(k=3)"
    assert repr(DrafterSpec(drafter="heads").build(random_model)) == "heads(k=4)"
    both = DrafterSpec(drafter="heads+prompt_lookup", num_draft=6).build(random_model)
    assert repr(both).startswith("heads(k=4)+prompt_lookup(num_draft=6")
    tree = DrafterSpec(drafter="auto", tree="tree8").build(random_model)
    assert repr(tree) == "heads(tree=tree8)" and tree.max_drafts == 7
    assert DrafterSpec(drafter="auto").measured and DrafterSpec(k="auto").measured
    with pytest.raises(ValueError, match="chosen by measurement"):
        DrafterSpec(drafter="auto").build(random_model)
    assert repr(DrafterSpec().build(random_model)) == "heads(k=4)"  # the default builds


@pytest.mark.parametrize("name, options, message", [
    ("lookahead", {"k": 2}, "k=2 sizes heads or heads.prompt_lookup, not drafter='lookahead'"),
    ("lookahead", {"num_draft": 3}, "num_draft=3 sizes .*, not drafter='lookahead'"),
    ("lookahead", {"max_ngram": 3}, "max_ngram=3 sizes prompt_lookup"),
    ("heads", {"window": 3}, "window=3 sizes lookahead, not drafter='heads'"),
    ("prompt_lookup", {"guesses": 3}, "guesses=3 sizes lookahead"),
    ("jacobi", {}, "unknown drafter 'jacobi': choose one of .*, lookahead"),
])

def test_bad_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        DrafterSpec(drafter=name, **options)
