"""Sequential heads (DeepSeek-V3's modules) as the drafter: greedy output equals autoregressive,
ragged batches, the static step, drafts equal to the teacher-forced modules', bad input.
(Sampling exactness: tests/decode/test_speculative_sampling.py.)"""

import pytest
import torch
from decode import common
from decode.common import SMALL_TREE, TOKENIZER, check_greedy, ids_of
from decode.test_drafters import check_k_auto_measures_the_heads_only  # tests/ is on the path

import mtp.decode.engine as engine
from mtp.generate import DrafterSpec, HeadsDrafter, SequentialDrafter, generate
from mtp.decode.sampling import SamplingConfig
from mtp.decode.forward import StackedHeads
from mtp.kv_cache import KVCache, cache_step, causal
from mtp.model import MTPConfig, MTPModel

# Ragged; "x" is shorter (2 tokens with the document start) than module 3's first token.
PROMPTS = [*common.PROMPTS, "x"]


@pytest.fixture
def random_sequential():
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=96, n_future=4, head_type="sequential")
    return MTPModel(config).double().eval()


def _drafters(model):
    return {"chain": SequentialDrafter(4), "k=2": DrafterSpec(drafter="heads", k=2),
            "tree16": DrafterSpec(drafter="heads", tree="tree16"),
            "small tree": SequentialDrafter(4, SMALL_TREE)}


@pytest.mark.parametrize("name", ["chain", "k=2", "tree16", "small tree"])
def test_greedy_equals_autoregressive_in_ragged_batches(trained_sequential, random_sequential,
                                                        name):
    for model in (trained_sequential, random_sequential):
        together = check_greedy(model, _drafters(model)[name], PROMPTS, 40, alone=3)
        if model is trained_sequential:
            assert max(g.stats.tokens_per_forward for g in together) > 1.8


@pytest.mark.parametrize("tree", [None, SMALL_TREE, "tree16"])
def test_drafts_are_the_teacher_forced_modules_predictions(trained_sequential, tree):
    """Wherever a draft's path so far is the text that came out, the draft is the r-th most
    likely token of module d at the root's position in a teacher-forced forward over that
    text: the drafter's caches hold exactly what training showed the modules."""
    model = trained_sequential
    seen = []

    class Recorder(SequentialDrafter):
        def propose(self):
            drafts = super().propose()
            seen.append((int(self._root[0]), [0, *drafts.tokens[0].tolist()]))
            return drafts

    if isinstance(tree, str):
        tree = DrafterSpec(drafter="heads", tree=tree).build(model).tree
    checked = 0
    for prompt in PROMPTS:
        seen.clear()
        drafter = Recorder(4, tree)
        [g] = generate(model, TOKENIZER, [prompt], max_new_tokens=40, drafter=drafter)
        text = [TOKENIZER.eos_id, *TOKENIZER.encode(prompt), *g.token_ids]
        with torch.no_grad():
            logits = model(torch.tensor([text]))[0]  # (T, n, V), teacher-forced
        t = drafter.tree
        for root, nodes in seen:  # nodes[u]: node u's token (u >= 1)
            for u in range(1, t.n_nodes):
                path = t.ancestors[u][1:-1]  # u's ancestors below the root
                depth = len(path) + 1
                if root + depth >= len(text) or any(
                        nodes[a] != text[root + i + 1] for i, a in enumerate(path)):
                    continue
                rank = t.paths[u - 1][-1]
                expected = logits[root - 1, depth].topk(rank + 1).indices[rank]
                assert nodes[u] == expected, (prompt, root, u)
                checked += 1
    assert checked > 60


@pytest.fixture
def static(monkeypatch):
    """compile=True runs the static step eagerly (as in tests/decode/test_engine.py)."""
    monkeypatch.setattr(engine, "_compiled", {False: engine.CompiledStep(engine.verify_and_accept)})


@pytest.mark.parametrize("drafter", [SequentialDrafter(4), SequentialDrafter(4, SMALL_TREE)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_static_step_decodes_as_the_eager_one(trained_sequential, static, drafter,
                                                  temperature):
    # Sampling draws as many numbers as the batch has rows, which differ between the steps
    # (finished rows stay in a static batch): one prompt then.
    prompts = PROMPTS if temperature == 0 else PROMPTS[:1]
    sampling = SamplingConfig(temperature=temperature)
    runs = [generate(trained_sequential, TOKENIZER, prompts, max_new_tokens=30, seed=3,
                     drafter=drafter, sampling=sampling, compile=compile, stop=["print"])
            for compile in (False, True)]
    assert ids_of(runs[0]) == ids_of(runs[1])
    if temperature == 0:
        reference = generate(trained_sequential, TOKENIZER, PROMPTS, max_new_tokens=30,
                             stop=["print"])
        assert ids_of(runs[1]) == ids_of(reference)


def test_auto_measures_the_modules(random_sequential):
    check_k_auto_measures_the_heads_only(random_sequential, SequentialDrafter)


def test_a_cache_holding_some_blocks_takes_the_models_block_indices(random_sequential):
    """The drafter's cache holds the modules' blocks only, indexed as the model's."""
    config = random_sequential.config
    first = config.n_layers + config.head_layers
    cache = KVCache(config, 1, 16, dtype=torch.float64, blocks=range(first, config.n_blocks))
    full = KVCache(config, 1, 16, dtype=torch.float64)
    tokens = torch.randint(0, 262, (1, 5))
    step = cache_step(torch.zeros(1, dtype=torch.long), *causal(5), key_len=5)
    hidden = torch.randn(1, 5, config.dim, dtype=torch.float64)
    with torch.no_grad():
        for store in (cache, full):
            random_sequential.mtp_module(hidden, tokens, 2, cache=store, step=step)
    assert cache.keys.shape[0] == config.n_blocks - first
    torch.testing.assert_close(cache.keys[2 - 1], full.keys[first + 1], rtol=0, atol=0)


def test_bad_input_names_the_head_type(random_sequential, tiny_config):
    with pytest.raises(ValueError, match="model.head_type='sequential'.*SequentialDrafter"):
        generate(random_sequential, TOKENIZER, ["x"], drafter=HeadsDrafter(3))
    with pytest.raises(ValueError, match="model.head_type='block': use HeadsDrafter"):
        generate(MTPModel(tiny_config), TOKENIZER, ["x"], drafter=SequentialDrafter(3))
    with pytest.raises(ValueError, match="k from 2 to n_future=4, got k=5"):
        generate(random_sequential, TOKENIZER, ["x"], drafter=SequentialDrafter(5))
    tokens = torch.randint(0, 262, (1, 4))
    with pytest.raises(ValueError, match="head 1 is a sequential module"):
        random_sequential.head(random_sequential.trunk(tokens), 1)
    with pytest.raises(ValueError, match="head 0 is not a sequential module"):
        random_sequential.mtp_module(torch.zeros(1, 4, 32), tokens, 0)
    with pytest.raises(ValueError, match="sequential heads form a chain"):
        StackedHeads(random_sequential, 2)
    cache = KVCache(random_sequential.config, 1, 8)
    step = cache_step(torch.zeros(1, dtype=torch.long), *causal(4), key_len=4)
    with pytest.raises(ValueError, match="a cached forward runs head 0 only"):
        random_sequential(tokens, cache=cache, step=step)
