"""Lookahead decoding: greedy output equals autoregressive, the tree's mask and positions and
the n-gram pool against plain loops, the command lines, and bad input."""

import pytest
import torch
from decode.common import PROMPTS, TOKENIZER, check_greedy, ids_of

from mtp.checkpoint import export
from mtp.generate import Combined, DrafterSpec, HeadsDrafter, Lookahead, generate
from mtp.generate.__main__ import main
from mtp.decode.acceptance import accept
from mtp.decode.drafters.base import Verified
from mtp.decode.forward import hidden_states, prefill
from mtp.decode.drafters.lookahead import NgramPool, layout
from mtp.decode.sampling import SamplingConfig
from mtp.kv_cache import KVCache, cache_step
from mtp.model import MTPModel

SIZES = [(5, 4, 5), (2, 2, 0), (3, 3, 2), (4, 5, 1), (3, 2, 3)]  # (W, N, G)


@pytest.mark.parametrize("window, ngram, guesses", SIZES)
def test_greedy_equals_autoregressive_on_a_random_model(random_model, window, ngram, guesses):
    # 60 new tokens run past the context of 64: every sequence ends with "context".
    check_greedy(random_model, Lookahead(window, ngram, guesses), PROMPTS[:4], 60, alone=2)


def test_greedy_equals_autoregressive_on_a_trained_model(trained):
    reference = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40)
    for window, ngram, guesses in SIZES[:3]:
        drafter = Lookahead(window, ngram, guesses)
        generations = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40, drafter=drafter)
        assert ids_of(generations) == ids_of(reference)
        assert [g.finish_reason for g in generations] == [g.finish_reason for g in reference]
        for g in generations:
            assert g.stats.forward_passes <= g.stats.new_tokens
            # one histogram entry per acceptable depth (the tree's), not per node
            assert len(g.stats.accepted_depths) == drafter.tree.depth + 1 <= drafter.max_drafts + 1
        if guesses:  # the recited loop body is in the prompt's n-grams: several tokens a step
            assert generations[-1].stats.tokens_per_forward > 1.5


def test_layout_is_lookahead_decodings_mask():
    """Node by node: R_l[c] sees R_0[0..c] and R_1[c]..R_l[c]; guess g's chain from the root."""
    window, rows, guesses, length = 4, 3, 2, 3
    plan = layout(window, rows, guesses, length)
    tree = plan.tree
    assert tree.n_nodes == 1 + (window - 1) + (rows - 1) * window + guesses * length
    at = {0: 0} | {index: node + 1 for node, index in enumerate(plan.source)}  # flat -> node
    for row in range(rows):
        for c in range(window if row else 1):
            seen = [at[i] for i in range(c + 1)] + [at[r * window + c] for r in range(1, row + 1)]
            assert tree.ancestors[at[row * window + c]] == seen
            assert len(seen) - 1 == row + c  # depth = the position offset
    for g in range(guesses):
        for j in range(length):
            chain = [at[rows * window + g * length + i] for i in range(j + 1)]
            assert tree.ancestors[at[rows * window + g * length + j]] == [0] + chain
    assert plan.top == [at[(rows - 1) * window + c] for c in range(window)]
    assert tree.ancestors[1][-1] == at[rows * window]  # guesses come first among the children


@torch.no_grad()
def _full_step(model, window, ngram, guesses, prompt="xabcxabdxab"):
    """One lookahead forward with a full window of random tokens, by hand: its parts."""
    ids = TOKENIZER.encode_prompt(prompt)
    drafter = Lookahead(window, ngram, guesses)
    drafter.start(model, [ids], KVCache(model.config, 1, 64), SamplingConfig(), None)
    row = drafter._rows[0]
    row.window = [row.window[0]] + [torch.randint(0, 262, (window,)).tolist()
                                    for _ in range(ngram - 2)]
    row.window[0][0] = ids[-1]  # the root
    cache = KVCache(model.config, 1, 64, dtype=torch.float64)
    lengths, _, _ = prefill(model, cache, [ids[:-1]], 1, TOKENIZER.pad_id)
    drafts = drafter.propose()
    pending = torch.cat([torch.tensor([[ids[-1]]]), drafts.tokens], dim=1)
    buffers = drafter.tree.buffers("cpu")
    step = cache_step(lengths, buffers.depths, buffers.visible, key_len=64)
    hidden, _ = hidden_states(model, pending, cache, step, 1)  # (1, m, 1, D)
    return ids[:-1], drafter, drafts, pending, model.unembed(hidden[:, :, 0]), hidden


@torch.no_grad()
def _plain(model, ids):
    return model(torch.tensor([ids]))[0, -1, 0]  # head 0's logits after `ids`, no cache


@pytest.mark.parametrize("window, ngram, guesses", [(4, 4, 2), (3, 2, 1)])
def test_every_node_sees_exactly_its_own_sequence(random_model, window, ngram, guesses):
    prefix, drafter, drafts, pending, target, _ = _full_step(random_model, window, ngram,
                                                             guesses)
    rows = drafter._rows[0].window
    found = drafter._rows[0].pool.guesses(rows[0][0])
    assert len(found) == guesses and drafter.tree.n_nodes == 1 + drafts.count
    # Each node's virtual sequence, built from the window and the pool alone.
    virtual = [rows[0][:c + 1] for c in range(window)]
    virtual += [rows[0][:c + 1] + [rows[r][c] for r in range(1, row + 1)]
                for row in range(1, ngram - 1) for c in range(window)]
    pad = found * guesses
    virtual += [[rows[0][0], *pad[g][:j + 1]] for g in range(guesses) for j in range(ngram - 1)]
    flat_index = [c for c in range(window)] + [r * window + c for r in range(1, ngram - 1)
                                               for c in range(window)]
    flat_index += [(ngram - 1) * window + i for i in range(guesses * (ngram - 1))]
    plan = layout(window, ngram - 1, guesses, ngram - 1)
    at = {0: 0} | {index: node + 1 for node, index in enumerate(plan.source)}
    for index, sequence in zip(flat_index, virtual, strict=True):
        node = at[index]
        assert pending[0, node] == sequence[-1]
        torch.testing.assert_close(target[0, node], _plain(random_model, prefix + sequence))


def test_the_pool_collects_each_columns_ngram(random_model):
    window, ngram = 4, 3
    prefix, drafter, drafts, pending, target, hidden = _full_step(random_model, window, ngram,
                                                                  guesses=8)
    old = [list(r) for r in drafter._rows[0].window]
    result = accept(drafts, target, drafter.tree)
    n = int(result.n_accepted[0])
    new_ids = [result.tokens[0, :n + 1].tolist()]
    path = drafter.tree.buffers("cpu").ancestors[result.node]
    drafter.update(Verified(pending, hidden, target.argmax(-1), path, result.n_accepted + 1,
                            result.tokens, new_ids))
    row = drafter._rows[0]
    new = []
    for c in range(window):  # the plain Jacobi step of column c
        column = old[0][:c + 1] + [old[r][c] for r in range(1, ngram - 1)]
        new.append(int(_plain(random_model, prefix + column).argmax()))
        gram = tuple(old[r][c] for r in range(1, ngram - 1)) + (new[c],)
        assert gram in row.pool.guesses(old[0][c])
    # The window moved on by one Jacobi step: rows up, new last, the new root first.
    assert row.window[0] == [new_ids[0][-1]] + old[1][1:]
    assert row.window[1:] == old[2:] + [new]


def test_ngram_pool_is_lru_per_first_token():
    pool = NgramPool(2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 9, 9)]:
        pool.add(gram[0], gram[1:])
    assert pool.guesses(1) == [(6, 7), (2, 3)]  # (4, 5) was the least recently seen
    assert pool.guesses(9) == [(9, 9)] and pool.guesses(5) == []
    text = NgramPool(4)
    text.add_text([5, 6, 7, 5, 6, 8], 3)
    assert text.guesses(5) == [(6, 8), (6, 7)] and text.guesses(6) == [(7, 5)]
    text.add_text([5, 6, 7, 5, 6, 8, 6, 1], 3, start=6)  # only the n-grams ending at 6, 7
    assert text.guesses(8) == [(6, 1)] and text.guesses(6) == [(8, 6), (7, 5)]
    assert text.guesses(5) == [(6, 8), (6, 7)]


def test_near_the_cache_end_and_after_finished_rows(trained):
    """Rows finish at different steps (EOS, a stop string, the context's end); the last
    steps' trees reach past the context, whose drafts are never kept."""
    prompts = PROMPTS + ["def add(a, b):\n    return a + b\n" * 2 + "for i in range(10):\n"]
    reference = generate(trained, TOKENIZER, prompts, max_new_tokens=90, stop=["print"])
    got = generate(trained, TOKENIZER, prompts, max_new_tokens=90, drafter=Lookahead(6, 5, 4),
                   stop=["print"])
    assert ids_of(got) == ids_of(reference)
    reasons = [g.finish_reason for g in reference]
    assert {"stop", "context"} <= set(reasons)  # some rows finished early, one ran to the end
    assert [g.finish_reason for g in got] == reasons


def test_command_lines(tiny_config, tmp_path, capsys):
    model = MTPModel(tiny_config)
    directory = export(model, TOKENIZER, tmp_path / "export")
    main([f"checkpoint={directory}", "prompt='def f(x):'", "max_new_tokens=10",
          "drafter=lookahead", "window=3", "ngram=3", "guesses=2", "exact=false"])
    out, err = capsys.readouterr()
    [expected] = generate(model.eval(), TOKENIZER, ["def f(x):"], max_new_tokens=10)
    assert out == "def f(x):" + expected.text + "\n"
    kernels, dtype, threads, exact, stats = err.splitlines()  # the choices first (threads: set)
    assert threads.startswith("threads: 1 (set: ")
    assert exact == "exact: off (set)"
    assert stats.startswith("[length] lookahead(window=3, ngram=3, guesses=2): 10 tokens in ")
    drafter = DrafterSpec(drafter="lookahead", ngram=2).build(model)
    assert (drafter.window, drafter.ngram, drafter.guesses) == (5, 2, 5)
    with pytest.raises(ValueError, match="window=1 must be an integer >= 2"):
        main([f"checkpoint={directory}", "prompt=x", "drafter=lookahead", "window=1"])


@pytest.mark.parametrize("make, message", [
    (lambda: Lookahead(window=1), "window=1 must be an integer >= 2"),
    (lambda: Lookahead(ngram=1), r"ngram=1 must be an integer >= 2 \(the n-gram size N\): a "
                                 r"1-gram has no continuation to propose"),
    (lambda: Lookahead(guesses=-1), "guesses=-1 must be an integer >= 0"),
    (lambda: Lookahead(window=2.5), "window=2.5 must be an integer >= 2"),
    (lambda: Combined(HeadsDrafter(2), Lookahead()), "not the candidate tree of lookahead"),
])
def test_bad_sizes(make, message):
    with pytest.raises(ValueError, match=message):
        make()
