import pytest
import torch

from mtp.kv_cache import KVCache
from mtp.model import MTPModel


@pytest.fixture
def model(tiny_config):
    return MTPModel(tiny_config).double().eval()


def _cache(model, batch=1, max_len=32):
    return KVCache(model.config, batch, max_len, dtype=torch.float64)


@torch.no_grad()
def test_cached_logits_equal_full_recomputation_for_every_head(model):
    tokens = torch.randint(0, 262, (2, 12))
    full = model(tokens)  # (B, T, n, V)
    cache = _cache(model, batch=2)
    pieces = [model(tokens[:, :5], cache=cache)]  # prefill, then steps of 1 and 3 tokens
    pieces += [model(tokens[:, 5:6], cache=cache), model(tokens[:, 6:9], cache=cache)]
    pieces += [model(tokens[:, t:t + 1], cache=cache) for t in range(9, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
    assert cache.lengths == [12, 12]


@torch.no_grad()
def test_rollback_forgets_rejected_positions(model):
    tokens = torch.randint(0, 262, (1, 10))
    cache = _cache(model)
    model(tokens[:, :6], cache=cache)
    model(torch.randint(0, 262, (1, 3)), cache=cache)  # a rejected draft
    cache.rollback([6])
    resumed = model(tokens[:, 6:], cache=cache)
    torch.testing.assert_close(resumed, model(tokens)[:, 6:])


@torch.no_grad()
def test_ragged_lengths_match_each_sequence_alone(model):
    a, b = torch.randint(0, 262, (1, 9)), torch.randint(0, 262, (1, 9))
    cache = _cache(model, batch=2)
    model(torch.cat([a[:, :7], b[:, :7]]), cache=cache)
    cache.rollback([7, 4])  # sequence b keeps only 4 tokens
    step = model(torch.cat([a[:, 7:9], b[:, 4:6]]), cache=cache)
    torch.testing.assert_close(step[0], model(a)[0, 7:9])
    torch.testing.assert_close(step[1], model(b[:, :6])[0, 4:6])
    assert cache.lengths == [9, 6]


def test_cache_errors_are_clear(model):
    cache = _cache(model, max_len=8)
    with pytest.raises(ValueError, match="exceed the cache's max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cannot roll back from 0 to 3"):
        cache.rollback([3])
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=64"):
        KVCache(model.config, 1, 65)


# A tree over 7 new tokens: node 0 is the root; parents[i] < i. Root-to-leaf paths:
# 0-1-3-6, 0-1-4, 0-2-5.
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def _tree_layout(parents):
    """Depths (m,) and ancestor-or-self visibility (m, m) of a tree given by parent links."""
    m = len(parents)
    depths, visible = [0] * m, torch.eye(m, dtype=torch.bool)
    for node in range(1, m):
        depths[node] = depths[parents[node]] + 1
        visible[node] |= visible[parents[node]]
    return torch.tensor(depths), visible


def _path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("stacked", [False, True])
@torch.no_grad()
def test_tree_step_equals_each_root_to_leaf_path_on_its_own(model, stacked):
    """Every node's logits equal a plain forward over prefix + its path; ragged prefixes."""
    from mtp.generate.speculative import hidden_states
    from mtp.generate.stacked_heads import StackedHeads

    prefixes = [torch.randint(0, 262, (9,)), torch.randint(0, 262, (9,))]
    lengths = [9, 5]
    tree = torch.randint(0, 262, (2, len(PARENTS)))  # each row's own tokens, one tree shape
    cache = _cache(model, batch=2)
    model(torch.stack(prefixes), cache=cache)
    cache.rollback(lengths)
    depths, visible = _tree_layout(PARENTS)
    cache.masked_step(depths, visible)
    heads = StackedHeads(model, 4) if stacked else 4
    logits = model.unembed(hidden_states(model, cache, tree, heads))  # (B, m, n, V)
    assert cache.lengths == [9 + 7, 5 + 7]
    for row, length in enumerate(lengths):
        for node in range(len(PARENTS)):
            path = tree[row, _path(PARENTS, node)]
            alone = model(torch.cat([prefixes[row][:length], path])[None])[0, -1]  # (n, V)
            torch.testing.assert_close(logits[row, node], alone)


@torch.no_grad()
def test_compacted_path_continues_as_if_decoded_alone(model):
    """Rows keep different paths (one a plain prefix); decoding then matches recomputation."""
    prefix = torch.randint(0, 262, (2, 6))
    tree = torch.randint(0, 262, (2, len(PARENTS)))
    cache = _cache(model, batch=2)
    model(prefix, cache=cache)
    cache.masked_step(*_tree_layout(PARENTS))
    model(tree, cache=cache)
    kept = [_path(PARENTS, 6), [0, 1]]  # 0-1-3-6 moves; 0-1 is already in place
    cache.compact(kept)
    assert cache.lengths == [6 + 4, 6 + 2]
    following = torch.randint(0, 262, (2, 3))
    cache.rollback([10, 8])
    out = model(following[:, :1], cache=cache)  # one token each, ragged lengths
    for row in range(2):
        sequence = torch.cat([prefix[row], tree[row, kept[row]], following[row, :1]])
        torch.testing.assert_close(out[row, 0], model(sequence[None])[0, -1])


@torch.no_grad()
def test_masked_step_errors_are_clear(model):
    cache = _cache(model)
    model(torch.randint(0, 262, (1, 4)), cache=cache)
    depths, visible = _tree_layout(PARENTS)
    with pytest.raises(ValueError, match=r"visible must be a \(7, 7\) bool tensor"):
        cache.masked_step(depths, visible[:3, :3])
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, 7\), got \[7"):
        cache.masked_step(depths + 7, visible)
    with pytest.raises(ValueError, match="every new token must see itself"):
        cache.masked_step(depths, visible & ~torch.eye(7, dtype=torch.bool))
    cache.masked_step(depths, visible)
    with pytest.raises(ValueError, match="masked_step\\(\\) planned 7 new tokens, but the "
                                         "forward pass has 3"):
        model(torch.randint(0, 262, (1, 3)), cache=cache)
    cache.rollback([4])
    model(torch.randint(0, 262, (1, 7)), cache=cache)
    with pytest.raises(ValueError, match=r"kept tokens must be distinct indices of the last "
                                         r"step's 7 new tokens, got \[0, 7\]"):
        cache.compact([[0, 7]])
