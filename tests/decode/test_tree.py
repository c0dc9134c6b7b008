"""Candidate trees: validation, construction from rates, buffers, and tree acceptance."""

import json

import pytest
import torch

from mtp.decode.acceptance import AcceptanceSettings, Draws, TypicalAcceptance, accept
from mtp.decode.drafters.base import Drafts
from mtp.decode.drafters.heads import draft
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import (TREE_FILE, Calibration, DynamicTree, Tree, TreeBuffers,
                             best_paths, resolve_tree)

MEDUSA_LIKE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_nodes_are_ordered_by_depth_then_rank_with_parent_links():
    tree = Tree(tuple(reversed(MEDUSA_LIKE)))
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tree.ancestors[7] == [0, 1, 4, 7]
    assert tree.n_nodes == 8 and tree.depth == 3 and tree.n_ranks == 3
    assert tree.widths == [3, 2, 1]
    buffers = tree.buffers("cpu")
    assert buffers.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert buffers.visible[7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    assert buffers.visible.sum().item() == sum(len(a) for a in tree.ancestors)
    assert buffers.children[1].tolist() == [4, 5, -1]
    # node (1, 0) is head 2's top-1: topk of heads (1, 2, 3) flattened with 3 ranks each
    assert buffers.draft_index.tolist() == [0, 1, 2, 3, 4, 3, 6]


def test_chain_and_presets():
    assert Tree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    for size in (8, 16, 32, 64):
        tree = resolve_tree(f"tree{size}", k=8, vocab_size=262)
        assert tree.n_nodes == size and tree.depth <= 7
    small = resolve_tree("tree64", k=3, vocab_size=262)  # presets fit the heads used
    assert small.n_nodes == 64 and small.depth == 2
    assert resolve_tree("chain", k=5, vocab_size=262).depth == 4


def test_from_rates_takes_the_most_probable_paths():
    rates = [[0.5, 0.3, 0.1], [0.9, 0.05, 0.0], [0.2, 0.1, 0.1]]
    tree = Tree.from_rates(rates, 6)
    # path probabilities: (0) .5, (0,0) .45, (1) .3, (1,0) .27, (0,0,0) .09, (2) .1
    assert set(tree.paths) == {(0,), (0, 0), (1,), (1, 0), (2,)}
    # every prefix-closed 5-path tree has a smaller expected accepted length
    value = {p: 1.0 for p in [()]}
    for path in sorted({(a,) for a in range(3)} | {(a, b) for a in range(3) for b in range(3)}
                       | {(a, b, c) for a in range(3) for b in range(3) for c in range(3)},
                       key=len):
        value[path] = value[path[:-1]] * rates[len(path) - 1][path[-1]]
    chosen = sum(value[p] for p in tree.paths)
    assert chosen == pytest.approx(0.5 + 0.45 + 0.3 + 0.27 + 0.1)
    assert chosen >= max(value[(0,)] + value[(0, 0)] + value[(0, 0, 0)] + value[(1,)]
                         + value[(1, 0)], 0)


@pytest.mark.parametrize("paths, message", [
    ([[0], [0]], r"path \[0\] appears twice"),
    ([[0], []], r"path \[\] must be a non-empty list of ranks"),
    ([[0], [-1]], r"path \[-1\] must be a non-empty list"),
    ([[0], [1, 0]], r"path \[1, 0\] needs its parent \[1\]"),
])
def test_malformed_trees_name_the_path(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree(tuple(paths))


def test_trees_the_model_cannot_draft_name_the_path():
    with pytest.raises(ValueError, match=r"path \[0, 0, 0\] has depth 3, but heads 1..2"):
        resolve_tree([[0], [0, 0], [0, 0, 0]], k=3, vocab_size=262)
    with pytest.raises(ValueError, match=r"path \[4\] has rank 4, beyond the vocabulary of 4"):
        resolve_tree([[0], [4]], k=3, vocab_size=4)
    with pytest.raises(ValueError, match="unknown tree 'tree9'"):
        resolve_tree("tree9", k=3, vocab_size=262)
    with pytest.raises(ValueError, match=r"tree='auto:8' needs measured acceptance rates"):
        resolve_tree("auto:8", k=3, vocab_size=262)


def test_calibration_round_trip_and_mismatch(tmp_path):
    rates = [[0.5, 0.2], [0.6, 0.1], [0.7, 0.05]]
    def load(directory, n_future=4):
        return Calibration.load(directory / TREE_FILE, n_future=n_future, vocab_size=262)

    Calibration(rates, n_future=4, vocab_size=262, details={"prompts": 3}).save(tmp_path)
    found = load(tmp_path)
    assert found.rates == rates and found.details == {"prompts": 3}
    tree = resolve_tree("auto:5", k=4, vocab_size=262, calibration=found)
    assert tree.n_nodes == 5 and tree.paths == Tree.from_rates(rates, 5).paths
    assert resolve_tree("auto:9", k=2, vocab_size=262, calibration=found).depth == 1
    with pytest.raises(ValueError, match=r"tree.json was calibrated for n_future=4, "
                                         r"vocab_size=262, not this model's n_future=8"):
        load(tmp_path, n_future=8)
    (tmp_path / "paths.json").write_text(json.dumps([[0], [1, 3]]))
    with pytest.raises(ValueError, match=r"paths.json: path \[1, 3\] needs its parent \[1\]"):
        resolve_tree(str(tmp_path / "paths.json"), k=4, vocab_size=262)
    (tmp_path / "empty").mkdir()
    paths = [((0,), 0.7), ((0, 0), 0.5), ((1,), 0.2), ((0, 0, 0), 0.1)]
    Calibration(rates, n_future=4, vocab_size=262, paths=paths).save(tmp_path / "empty")
    found = load(tmp_path / "empty")
    assert found.paths == paths
    assert resolve_tree("auto:4", k=4, vocab_size=262, calibration=found).paths == (
        (0,), (1,), (0, 0))  # the three most frequent paths, not the rates' tree
    assert set(resolve_tree("auto:3", k=2, vocab_size=262, calibration=found).paths) == {
        (0,), (1,)}  # within heads 0..1: depth 1 only
    data = json.loads((tmp_path / "empty" / "tree.json").read_text())
    data["paths"]["0,0,0,0"] = 0.05
    (tmp_path / "empty" / "tree.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"paths must map rank paths of depth 1..3"):
        load(tmp_path / "empty")


def _logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_greedy_acceptance_takes_the_path_head_0_agrees_with():
    tree = Tree(((0,), (1,), (0, 0), (1, 0), (1, 1)))  # nodes: 1:(0) 2:(1) 3:(0,0) 4:(1,0) 5:(1,1)
    # head 0's argmax after each node 0..5
    predicted = [7, 1, 3, 1, 2, 1]
    target = torch.full((1, 6, 10), -1.0, dtype=torch.float64)
    target[0, torch.arange(6), torch.tensor(predicted)] = 0.0
    drafts = Drafts(torch.tensor([[5, 7, 3, 2, 3]]))  # node 2 (7), then 5 (3) agree
    result = accept(drafts, target, tree)
    assert result.node.tolist() == [5] and result.n_accepted.tolist() == [2]
    assert result.tokens[0, :3].tolist() == [7, 3, 1]  # the path, then head 0 after node 5
    nothing = accept(Drafts(torch.tensor([[0, 0, 0, 0, 0]])), target, tree)
    assert nothing.node.tolist() == [0] and nothing.tokens[0, 0].item() == 7


def test_typical_acceptance_keeps_likely_drafts_and_is_greedy_at_temperature_0():
    tree = Tree(((0,), (1,)))
    p_root = [0.5, 0.42, 0.08]
    target = _logits([[p_root, [1 / 3] * 3, [1 / 3] * 3]])
    typical = TypicalAcceptance(epsilon=0.09, alpha=0.3)
    # threshold: min(0.09, 0.3 * exp(-H)) = 0.09 here; both 0 and 1 pass, 2 does not
    draws = Draws.draw(1, 3, 3, None, "cpu")
    for tokens, node in (([0, 1], 1), ([2, 1], 2), ([2, 2], 0)):
        result = accept(Drafts(torch.tensor([tokens])), target, tree,
                        AcceptanceSettings(SamplingConfig(temperature=1.0), typical), draws)
        assert result.node.tolist() == [node]
    greedy = accept(Drafts(torch.tensor([[1, 0]])), target, tree,
                    AcceptanceSettings(rule=TypicalAcceptance()))
    assert greedy.node.tolist() == [2]  # only head 0's argmax (token 0, node 2) is kept


def test_sibling_candidates_keep_head_0s_distribution():
    """One level of 3 siblings drawn without replacement from q: the output is exactly p."""
    n, vocab = 40_000, 5
    p = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4], dtype=torch.float64)
    q = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05], dtype=torch.float64)
    tree = Tree(((0,), (1,), (2,)))
    generator = torch.Generator().manual_seed(0)
    head_logits = q.log().expand(n, 1, vocab)
    sampling = SamplingConfig(temperature=1.0)
    sampled = AcceptanceSettings(sampling)
    drafts = draft(head_logits, tree, sampling, generator)
    assert (drafts.tokens[:, 0] != drafts.tokens[:, 1]).all()  # without replacement
    target = p.log().expand(n, 4, vocab)  # after each sibling: p again (a stationary source)
    result = accept(drafts, target, tree, sampled, Draws.draw(n, 4, vocab, generator, "cpu"))
    first = torch.bincount(result.tokens[:, 0], minlength=vocab).double() / n
    torch.testing.assert_close(first, p, atol=0.01, rtol=0)
    # The test has power: accepting each sibling with p(x)/q(x) but resampling from p
    # (not the residual) after rejections is far off; and siblings do accept more often.
    accepted = (result.n_accepted == 1).double().mean()
    assert accepted > torch.minimum(p, q).sum() + 0.1
    # Deterministic (one-hot) siblings, as the greedy top-k would give: also exact.
    fixed = Drafts(torch.tensor([[4, 3, 0]]).expand(n, 3))
    result = accept(fixed, target, tree, sampled, Draws.draw(n, 4, vocab, generator, "cpu"))
    first = torch.bincount(result.tokens[:, 0], minlength=vocab).double() / n
    torch.testing.assert_close(first, p, atol=0.01, rtol=0)
    assert (result.n_accepted == 1).double().mean() == pytest.approx(0.4 + 0.25 + 0.05,
                                                                      abs=0.01)


def test_a_tree_drafter_cannot_be_combined():
    from mtp.generate import Combined, HeadsDrafter, PromptLookup

    with pytest.raises(ValueError, match=r"not the candidate tree of heads\(tree=custom\)"):
        Combined(HeadsDrafter(4, Tree(((0,), (1,)))), PromptLookup())
    Combined(HeadsDrafter(4), PromptLookup())  # the chain is fine


def test_a_dynamic_trees_buffers_equal_a_fixed_trees():
    """Built from each row's parents (a step's own tree), the buffers are those the fixed
    tree of the same shape builds."""
    tree = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    fixed = tree.buffers("cpu")
    parents = torch.tensor([tree.parents[1:], tree.parents[1:]])
    built = TreeBuffers.from_parents(parents, tree.depth, branching=3)
    for name in ("depths", "visible", "parents", "ancestors", "children"):
        assert torch.equal(getattr(built, name), getattr(fixed.rows(2), name)), name
    with pytest.raises(ValueError, match="is chosen at every step"):
        DynamicTree.of(8, 3, 4).buffers("cpu")
    assert DynamicTree.of(8, 3, 4).widths == [4, 4, 4]
    assert resolve_tree("dynamic:16", k=4, vocab_size=262).n_nodes == 16
    with pytest.raises(ValueError, match="dynamic:N needs a node budget N >= 2"):
        resolve_tree("dynamic:1", k=4, vocab_size=262)


def test_best_paths_keep_the_largest_cumulative_scores_parents_first():
    # Depth 1: ranks score log 0.6, 0.3, 0.1; depth 2: 0.9, 0.05, 0.05.
    scores = torch.tensor([[[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]]).log()
    depth, rank, parents = best_paths(scores, n_nodes=5)
    # The 4 best paths: (0) .6, (0,0) .54, (1) .3, (1,0) .27; in depth order, parents first.
    assert depth.tolist() == [[1, 1, 2, 2]] and rank.tolist() == [[0, 1, 0, 0]]
    assert parents.tolist() == [[0, 0, 1, 2]]
    depth, rank, parents = best_paths(scores, n_nodes=3)
    assert (depth.tolist(), rank.tolist(), parents.tolist()) == ([[1, 2]], [[0, 0]], [[0, 1]])
