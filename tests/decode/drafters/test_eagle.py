"""The EAGLE-3 drafter: greedy output equals autoregressive decoding (ragged batches, chains
and trees, exact mode), its drafts are what training-time test trains, EAGLE-2's dynamic
tree, its files, and bad input. (Lossless sampling: test_eagle_sampling.py; training:
tests/train/test_eagle.py; the EAGLE-3 export: tests/interop/test_eagle3.py.)"""

import pytest
import torch
from conftest import DOCS, recite_docs
from safetensors.torch import save_file
from decode import common
from decode.common import SMALL_TREE, TOKENIZER, check_greedy, ids_of

import mtp.decode.engine as engine
from mtp.decode.drafters.base import DrafterContext, Drafts
from mtp.decode.drafters.eagle import EagleDrafter, dynamic_tree
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig, check_map, default_layers
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.loop import generate
from mtp.decode.tree import DynamicTree, Tree
from mtp.model import MTPConfig, MTPModel
from mtp.train.eagle import draft_vocabulary, inverse_map, target_outputs, unrolled, unrolled_loss

PROMPTS = [*common.PROMPTS, "x"]


def train_eagle(model: MTPModel, steps: int, unroll: int = 3, draft_vocab: int = 48) -> Eagle:
    """An EAGLE drafter trained for `steps` steps on DOCS (training-time test), float64."""
    torch.manual_seed(0)
    stream = torch.tensor([t for _ in range(20) for doc in DOCS
                           for t in TOKENIZER.encode(doc) + [TOKENIZER.eos_id]])
    d2t = draft_vocabulary(torch.bincount(stream, minlength=model.config.vocab_size),
                           draft_vocab)
    module = Eagle(EagleConfig.for_target(model.config, len(d2t)), d2t).double()
    t2d = inverse_map(d2t, model.config.vocab_size)
    compute = target_outputs(module.config.layers, 32)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - 32 - unroll, (8,)).tolist()
        tokens = torch.stack([stream[s:s + 32 + unroll] for s in starts])
        with torch.no_grad():
            features, targets = compute(model, tokens)
        unrolled_loss(module, model, features, tokens, targets, t2d, unroll).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return module.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def target() -> MTPModel:
    """A one-head byte model that has learnt DOCS (float64)."""
    return recite_docs(n_future=1, dim=32, steps=200)


@pytest.fixture(scope="session")
def trained_eagle(target) -> Eagle:
    return train_eagle(target, steps=150)


@pytest.fixture
def random_pair():
    """A random target of three trunk layers and a random drafter over 100 of its tokens."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=96)
    model = MTPModel(config).double().eval()
    d2t = torch.randperm(262)[:100].sort().values
    return model, Eagle(EagleConfig.for_target(config, 100), d2t).double().eval()


def _drafters(module):
    return {"chain": EagleDrafter(module, 4), "tree": EagleDrafter(module, 3, SMALL_TREE),
            "tree16": EagleDrafter(module, 4, Tree.from_rates([[0.6, 0.3, 0.1]] * 4, 16)),
            "dynamic": EagleDrafter(module, 4, DynamicTree.of(10, 4, 3))}


@pytest.mark.parametrize("name", ["chain", "tree", "tree16", "dynamic"])
def test_greedy_equals_autoregressive_in_ragged_batches(target, trained_eagle, random_pair,
                                                        name):
    for model, module in ((target, trained_eagle), random_pair):
        together = check_greedy(model, _drafters(module)[name], PROMPTS, 40, alone=3)
        if model is target:  # the trained drafter drafts what the target recites
            assert min(g.stats.tokens_per_forward for g in together[:3]) > 1.5


@pytest.mark.parametrize("name", ["chain", "tree", "dynamic"])
def test_exact_mode_gives_the_reference_of_its_width(target, trained_eagle, name):
    drafter = _drafters(trained_eagle)[name]
    for width in (drafter.tree.n_nodes, drafter.tree.n_nodes + 2):
        reference = generate(target, TOKENIZER, PROMPTS, max_new_tokens=30, exact=True,
                             width=width)
        ours = generate(target, TOKENIZER, PROMPTS, max_new_tokens=30, drafter=drafter,
                        exact=True, width=width)
        assert ids_of(ours) == ids_of(reference)


def test_the_static_step_decodes_as_the_eager_one(target, trained_eagle, monkeypatch):
    """compile=True runs the static step eagerly (as in tests/decode/test_engine.py)."""
    monkeypatch.setattr(engine, "_compiled",
                        {False: engine.CompiledStep(engine.verify_and_accept)})
    reference = generate(target, TOKENIZER, PROMPTS, max_new_tokens=30, stop=["print"])
    for drafter in _drafters(trained_eagle).values():
        static = generate(target, TOKENIZER, PROMPTS, max_new_tokens=30, drafter=drafter,
                          compile=True, stop=["print"])
        assert ids_of(static) == ids_of(reference)


class Recorder(EagleDrafter):
    """Records each step's root position and drafts (row 0)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = []

    def propose(self):
        drafts = super().propose()
        self.seen.append((int(self._held[0]), drafts.tokens[0].tolist()))
        return drafts


@pytest.mark.parametrize("tree", [None, SMALL_TREE])
def test_drafts_are_what_training_time_test_trains(target, trained_eagle, tree):
    """Wherever a draft's path is the text that came out, the draft is the r-th most likely
    token of the unrolled training forward (`mtp.train.eagle.unrolled`) at the root's last
    entry, at the step of its depth: the drafter's cache holds exactly what training showed
    the layer, from the target's features and then from its own."""
    module, depths = trained_eagle, set()
    for prompt in PROMPTS:
        drafter = Recorder(module, 3, tree)
        [g] = generate(target, TOKENIZER, [prompt], max_new_tokens=40, drafter=drafter)
        text = torch.tensor([[TOKENIZER.eos_id, *TOKENIZER.encode(prompt), *g.token_ids]])
        T = text.shape[1] - 3
        with torch.no_grad():
            _, features = target.trunk_states(text, keep=module.config.layers)
            logits = unrolled(module, target, features[:, :T], text, steps=3)
        t = drafter.tree
        for root, drafts in drafter.seen:  # the root sits at position `root`
            nodes = [None, *drafts]
            for u in range(1, t.n_nodes):
                path = t.ancestors[u][1:-1]  # u's ancestors below the root
                depth = len(path) + 1
                if root - 1 >= T or any(nodes[a] != int(text[0, root + 1 + i])
                                        for i, a in enumerate(path)):
                    continue
                rank = t.paths[u - 1][-1]
                expected = logits[depth - 1][0, root - 1].topk(rank + 1).indices[rank]
                assert nodes[u] == int(module.d2t[expected]), (prompt, root, u)
                depths.add(depth)
    assert depths == {1, 2, 3}


def _eagle2(first, expand, depth, top_k, nodes):
    """EAGLE-2's tree for one row, written out with lists: the reference."""
    pool = [(float(s), int(x), 0, 1) for s, x in zip(*first.topk(top_k))]  # score, token,
    fed_of = {}  # pool number -> fed number                             parent, depth
    layer = list(range(1, top_k + 1))  # pool numbers of the nodes to feed
    for d in range(1, depth):
        fed_numbers = {n: len(fed_of) + 1 + i for i, n in enumerate(layer)}
        fed_of.update(fed_numbers)
        logp = expand([pool[n - 1][1] for n in layer], [fed_of.get(pool[n - 1][2], 0)
                                                        for n in layer], d)
        children = []
        for n, row in zip(layer, logp):
            for s, x in zip(*row.topk(top_k)):
                pool.append((pool[n - 1][0] + float(s), int(x), n, d + 1))
                children.append(len(pool))
        layer = sorted(children, key=lambda c: -pool[c - 1][0])[:top_k]
    best = sorted(range(1, len(pool) + 1), key=lambda n: (-pool[n - 1][0], n))[:nodes]
    kept = sorted(best)
    position = {n: i + 1 for i, n in enumerate(kept)}
    return ([pool[n - 1][1] for n in kept], [position.get(pool[n - 1][2], 0) for n in kept])


@pytest.mark.parametrize("depth, top_k, nodes", [(1, 3, 2), (3, 2, 7), (4, 3, 12), (2, 4, 20)])
def test_the_dynamic_tree_is_eagle2(depth, top_k, nodes):
    """Against a written-out EAGLE-2 on a drafter whose next-token log-probabilities depend
    on the token, the depth and the parent's number: every row's tree, parents first."""
    vocab, batch = 11, 3
    table = torch.randn(batch, 40, vocab, dtype=torch.float64).log_softmax(-1)

    def expand(tokens, parents, d):  # (B, k) -> (B, k, N), per row
        tokens, parents = torch.as_tensor(tokens), torch.as_tensor(parents)
        return table[torch.arange(len(table))[:, None], (tokens + 3 * d + parents) % 40]

    first = table[:, 0]
    tokens, parents, q = dynamic_tree(first, expand, depth=depth, top_k=top_k, nodes=nodes)
    assert q is None and tokens.shape == parents.shape == (batch, nodes)
    for row in range(batch):
        def one(t, p, d, row=row):
            return expand(torch.tensor([t] * batch), torch.tensor([p] * batch), d)[row]

        assert (tokens[row].tolist(), parents[row].tolist()) == _eagle2(
            first[row], one, depth, top_k, nodes)
        assert all(p < i + 1 for i, p in enumerate(parents[row].tolist()))
    with pytest.raises(ValueError, match="nodes=40 must be from 1 to the 12 candidates"):
        dynamic_tree(first, expand, depth=2, top_k=3, nodes=40)


class Dynamic(EagleDrafter):
    """Proposes EAGLE-2's tree of one branch (top_k=1) as the chain it is."""

    def __init__(self, module, n):
        super().__init__(module, n)
        self.seen, self.parents = [], []

    def propose(self):
        tokens, parents, q = self.dynamic(depth=self.num_draft, top_k=1, nodes=self.num_draft)
        self.seen.append(tokens[0].tolist())
        self.parents.append(parents.tolist())
        return Drafts(tokens)


def test_a_dynamic_tree_of_one_branch_is_the_chain(target, trained_eagle):
    chain, dynamic = Recorder(trained_eagle, 4), Dynamic(trained_eagle, 4)
    outputs = [generate(target, TOKENIZER, PROMPTS, max_new_tokens=30, drafter=d)
               for d in (chain, dynamic)]
    assert ids_of(outputs[0]) == ids_of(outputs[1])
    assert [drafts for _, drafts in chain.seen] == dynamic.seen
    assert len(dynamic.parents) > 10
    assert all(p == [[0, 1, 2, 3]] * len(p) for p in dynamic.parents)


class Wide(EagleDrafter):
    """Records EAGLE-2's tree (depth 3, top_k 2, 8 nodes) at every step, and proposes its
    nodes as a chain: mostly rejected, so decoding goes on as the target's."""

    def __init__(self, module):
        super().__init__(module, 8)
        self.seen = []

    def propose(self):
        tokens, parents, _ = self.dynamic(depth=3, top_k=2, nodes=8)
        self.seen.append((int(self._held[0]), tokens[0].tolist(), parents[0].tolist()))
        return Drafts(tokens)


def test_dynamic_nodes_are_their_parents_best_children(target, trained_eagle):
    """Every node of a wider dynamic tree is among its parent's two best children under the
    layer run along its path alone (the unrolled training forward): the tree's masks and
    positions, with several nodes fed at each depth."""
    module, checked = trained_eagle, 0
    for prompt in PROMPTS[:3]:
        drafter = Wide(module)
        [g] = generate(target, TOKENIZER, [prompt], max_new_tokens=12, drafter=drafter)
        text = [TOKENIZER.eos_id, *TOKENIZER.encode(prompt), *g.token_ids]
        for root, tokens, parents in drafter.seen:  # the root x_p sits at position `root`
            for u in range(1, len(tokens) + 1):
                path, node = [], u
                while node:
                    path.insert(0, tokens[node - 1])
                    node = parents[node - 1]
                seq = torch.tensor([text[:root + 1] + path])
                with torch.no_grad():
                    _, features = target.trunk_states(seq, keep=module.config.layers)
                    logits = unrolled(module, target, features[:, :root], seq, len(path))
                best = module.d2t[logits[-1][0, root - 1].topk(2).indices].tolist()
                assert path[-1] in best, (prompt, root, u, path)
                checked += 1
    assert checked >= 3 * 8 * 2


def test_a_drafter_is_saved_and_found(tmp_path, target, trained_eagle):
    path = trained_eagle.save(tmp_path / "eagle", {"steps": 150})
    loaded = Eagle.load(tmp_path / "eagle")
    assert trained_eagle.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in trained_eagle.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    reference = generate(target, TOKENIZER, PROMPTS, max_new_tokens=20)
    named = DrafterSpec("eagle", eagle=str(tmp_path / "eagle"), num_draft=3).build(target)
    saved = loaded.describe(str((tmp_path / "eagle" / "eagle.safetensors").resolve()))
    context = DrafterContext(saved={"eagle": saved})
    found = DrafterSpec("eagle", tree="tree16").build(target, context)
    assert (repr(named), repr(found)) == ("eagle(num_draft=3)", "eagle(tree=tree16)")
    for drafter in (named, found):
        assert ids_of(generate(target, TOKENIZER, PROMPTS, max_new_tokens=20,
                             drafter=drafter)) == ids_of(reference)
    spec = DrafterSpec("auto")
    assert [repr(d) for d in spec.candidates(target, context, {}, "eagle")] == [
        "eagle(num_draft=5)", "eagle(tree=tree16)", "eagle(tree=tree32)",
        "eagle(tree=dynamic:16)"]
    assert list(spec.candidates(target, DrafterContext(), {}, "eagle")) == []
    assert path.name == "eagle.json"


def test_bad_input_is_refused_in_one_line(tmp_path, target, trained_eagle, random_pair):
    other, _ = random_pair  # three trunk layers, not two
    with pytest.raises(ValueError, match="trained for a model with n_layers=2, but this model "
                                         "has n_layers=3"):
        generate(other, TOKENIZER, ["x"], drafter=EagleDrafter(trained_eagle))
    for field, value, shown in (("dim", 16, "dim=32, but this model has dim=16"),
                                ("vocab_size", 300, "vocab_size=262, but this model has "
                                                    "vocab_size=300")):
        config = MTPConfig(**{**target.config.to_dict(), field: value})
        with pytest.raises(ValueError, match=shown):
            EagleDrafter(trained_eagle).check(MTPModel(config), TOKENIZER)
    config = trained_eagle.config
    with pytest.raises(ValueError, match="entry 3 is 262, outside the target's vocabulary "
                                         "of 262 tokens"):
        check_map(torch.tensor([0, 5, 9, 262]), 262)
    with pytest.raises(ValueError, match="target token 5 twice"):
        Eagle(EagleConfig(**{**config.to_dict(), "draft_vocab_size": 3}),
              torch.tensor([5, 1, 5]))
    with pytest.raises(ValueError, match="names layer 2, but the target's trunk has layers "
                                         "0..1"):
        EagleConfig(**{**config.to_dict(), "layers": (0, 1, 2)})
    trained_eagle.save(tmp_path / "bad")
    state = {k: v.clone() for k, v in trained_eagle.state_dict().items()}
    state["d2t"][7] = 1000
    save_file(state, str(tmp_path / "bad" / "eagle.safetensors"))
    with pytest.raises(ValueError, match="entry 7 is 1000, outside"):
        Eagle.load(tmp_path / "bad")
    with pytest.raises(ValueError, match="no EAGLE drafter there"):
        DrafterSpec("eagle", eagle=str(tmp_path / "none")).build(target)
    with pytest.raises(ValueError, match="drafter=eagle needs a trained drafter"):
        DrafterSpec("eagle").build(target)
    with pytest.raises(ValueError, match="the heads' calibrated tree"):
        DrafterSpec("eagle", tree="auto:16")
    with pytest.raises(ValueError, match="depth 4"):
        DrafterSpec("eagle", tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], num_draft=3)
    assert default_layers(MTPConfig(vocab_size=8, n_layers=29)) == (1, 14, 26)  # the engines'
