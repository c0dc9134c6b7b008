"""`python -m mtp.train.eagle`: training-time test's unrolled loss against a written-out
reference, the draft vocabulary and its inverse, the target's cached outputs, and the command
end to end: it trains, saves, and `drafter=eagle` finds what it saved."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DOCS, recite_docs

from mtp.bench import tables
from mtp.checkpoint import export, load
from mtp.decode.drafters.base import DrafterContext
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.loop import generate
from mtp.generate.saved import saved_choices
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer
from mtp.train.eagle import (
    draft_vocabulary,
    inverse_map,
    parse_args,
    target_outputs,
    train_eagle,
    unrolled_loss,
)
from mtp.train.trunk_cache import TrunkCache


def _rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean() + eps) * weight


def _rotate(x, position, theta):
    """Rotary embedding of one head's vector x (hd,) at `position`: consecutive pairs as
    complex numbers, turned by position * theta ** (-2i / hd) (Meta's Llama)."""
    pairs = torch.view_as_complex(x.reshape(-1, 2).contiguous())
    angles = position / theta ** (torch.arange(0, len(x), 2, dtype=x.dtype) / len(x))
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten()


def reference_loss(module, model, features, tokens, targets, t2d, steps, decay):
    """Training-time test written out one query at a time (SafeAILab's traineagle3 attention:
    step j at position t sees step 0's keys at positions <= t and step i's key at t, i <= j):
    the weighted loss and each step's loss."""
    c, p = module.config, dict(module.named_parameters())
    H, K, hd, eps = c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps
    theta = model.config.rope_theta
    B, T = features.shape[:2]
    total, losses = 0.0, []
    for b in range(B):
        hidden = [features[b, t].flatten() @ p["fc.weight"].T for t in range(T)]  # step 0's
        keys, values = [], []  # per step: (T, K, hd)
        for j in range(steps):
            if b == 0:
                losses.append([])
            x = [torch.cat([_rms(model.tok_embeddings.weight[tokens[b, t + 1 + j]],
                                 p["input_norm.weight"], eps),
                            _rms(hidden[t], p["hidden_norm.weight"], eps)]) for t in range(T)]
            q = [(p["attention.wq.weight"] @ x[t]).reshape(H, hd) for t in range(T)]
            k = [(p["attention.wk.weight"] @ x[t]).reshape(K, hd) for t in range(T)]
            q = [torch.stack([_rotate(q[t][h], t + j, theta) for h in range(H)])
                 for t in range(T)]
            keys.append([torch.stack([_rotate(k[t][g], t + j, theta) for g in range(K)])
                         for t in range(T)])
            values.append([(p["attention.wv.weight"] @ x[t]).reshape(K, hd) for t in range(T)])
            out = []
            for t in range(T):
                seen = [(0, s) for s in range(t + 1)] + [(i, t) for i in range(1, j + 1)]
                heads = []
                for h in range(H):
                    g = h // (H // K)
                    scores = torch.stack([q[t][h] @ keys[i][s][g] for i, s in seen]) / hd ** 0.5
                    weights = scores.softmax(0)
                    heads.append(sum(w * values[i][s][g] for w, (i, s) in zip(weights, seen)))
                h1 = hidden[t] + p["attention.wo.weight"] @ torch.cat(heads)
                n = _rms(h1, p["ffn_norm.weight"], eps)
                mlp = p["feed_forward.w2.weight"] @ (F.silu(p["feed_forward.w1.weight"] @ n)
                                                     * (p["feed_forward.w3.weight"] @ n))
                out.append(h1 + mlp)
            for t in range(T):
                label = int(t2d[targets[b, t + 1 + j]])
                if label >= 0:
                    logits = p["lm_head.weight"] @ _rms(out[t], p["norm.weight"], eps)
                    losses[j].append(-logits.log_softmax(0)[label])
            hidden = out
    step_losses = [torch.stack(step).mean() for step in losses]
    total = sum(decay ** j * loss for j, loss in enumerate(step_losses))
    return total, [float(loss.detach()) for loss in step_losses]


def test_the_unrolled_loss_is_training_time_test_written_out():
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=40, dim=16, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=32, rope_theta=50.0)
    model = MTPModel(config).double().eval().requires_grad_(False)
    d2t = torch.tensor([0, 3, 4, 7, 9, 10, 15, 20, 21, 30, 33, 39])
    module = Eagle(EagleConfig.for_target(config, len(d2t)), d2t).double()
    module.init_weights(std=0.3)
    tokens = torch.randint(0, 40, (2, 7 + 3))
    features, targets = target_outputs(module.config.layers, 7)(model, tokens)
    t2d = inverse_map(d2t, 40)
    assert (t2d[targets] >= 0).any() and (t2d[targets] < 0).any()  # both kinds of position
    ours = unrolled_loss(module, model, features, tokens, targets, t2d, steps=3, decay=0.8)
    ours.loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    theirs, step_losses = reference_loss(module, model, features, tokens, targets, t2d, 3, 0.8)
    theirs.backward()
    # float64, but mtp rotates in float32 (`model.apply_rope`, its float32 tables)
    assert ours.step_losses == pytest.approx(step_losses, rel=1e-6)
    assert float(ours.loss.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    for name, parameter in module.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    assert draft_vocabulary(counts, 3).tolist() == [2, 3, 5]  # in id order
    assert draft_vocabulary(counts, 4).tolist() == [0, 2, 3, 5]
    assert draft_vocabulary(counts, 6).tolist() == [0, 2, 3, 4, 5, 7]  # only tokens seen
    assert draft_vocabulary(torch.tensor([1, 1, 1]), 2).tolist() == [0, 1]  # ties: lower id
    assert inverse_map(torch.tensor([2, 3, 5]), 8).tolist() == [-1, -1, 0, 1, -1, 2, -1, -1]
    with pytest.raises(ValueError, match="no tokens"):
        draft_vocabulary(torch.zeros(4, dtype=torch.long), 2)


def test_the_cache_keeps_the_targets_features_and_next_tokens(tiny_config):
    model = MTPModel(tiny_config).eval()
    calls = []
    compute = target_outputs((0, 1, 1), seq_len=6)
    cache = TrunkCache(lambda m, x: calls.append(len(x)) or compute(m, x))
    blocks = torch.randint(0, tiny_config.vocab_size, (4, 6 + 2))
    for order in ([0, 1], [2, 3], [3, 0]):
        features, after = cache.trunk_out(model, blocks[order], torch.tensor(order))
        direct = compute(model, blocks[order])
        assert features.shape == (2, 6, 3, tiny_config.dim) and after.shape == (2, 8)
        torch.testing.assert_close(features, direct[0], rtol=0, atol=0)
        assert torch.equal(after, direct[1])
    assert calls == [2, 2] and len(cache) == 4
    with torch.no_grad():
        logits = model(blocks[:1])[0, :, 0]
    assert torch.equal(cache.trunk_out(model, blocks[:1], torch.tensor([0]))[1][0],
                       logits.argmax(-1))


@pytest.fixture(scope="module")
def recited(tmp_path_factory):
    """A byte model that recites DOCS, exported, and a JSON lines corpus of DOCS."""
    root = tmp_path_factory.mktemp("eagle")
    export(recite_docs(n_future=1, dim=32, steps=200).float(), ByteTokenizer(), root / "target")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n"
                                             for _ in range(40) for doc in DOCS))
    return root


def test_the_command_trains_saves_and_is_found(recited, capsys):
    root = recited
    args = parse_args([f"checkpoint={root / 'target'}", f"data=[{root / 'docs.jsonl'}]",
                       f"out={root / 'eagle'}", "draft_vocab=40", "seq_len=32",
                       "batch_size=8", "max_steps=120", "unroll=3", "lr=3e-3",
                       "warmup_steps=10", "val_fraction=0.2", "log_every=40", "val_batches=2",
                       "precision=float32", f"output={root / 'shipped.json'}"])
    module, details = train_eagle(args)
    printed = capsys.readouterr().out
    assert [step for step, _, _ in details["history"]] == [40, 80, 120]  # the curve
    assert "| step 120: train loss" in tables.eagle(details)  # docs/benchmarks.md's table
    assert "val accuracy" in printed and "draft vocabulary 33 tokens" in printed
    written = json.loads((root / "eagle" / "eagle.json").read_text())
    assert written["weights"] == "eagle.safetensors" and written["details"]["steps"] == 120
    shipped = json.loads((root / "shipped.json").read_text())  # the saved choice, as a file
    assert Path(shipped["weights"]).is_absolute()
    model, tokenizer = load(root / "target")
    saved = saved_choices(root / "target")
    assert saved["eagle"]["config"] == module.config.to_dict()
    drafter = DrafterSpec("eagle").build(model, DrafterContext(saved=saved))
    prompts = ["def add(", "print('h"]
    reference = generate(model, tokenizer, prompts, max_new_tokens=30)
    ours = generate(model, tokenizer, prompts, max_new_tokens=30, drafter=drafter)
    assert [g.token_ids for g in ours] == [g.token_ids for g in reference]
    assert min(g.stats.tokens_per_forward for g in ours) > 1.5
    assert all(math.isfinite(v) for v in written["details"]["val_loss"])


def test_bad_arguments_are_one_line_errors():
    base = ["checkpoint=x", "data=[a.jsonl]"]
    for extra, message in ((["precision=half"], "precision='half' is not one of"),
                           (["layers=[1,2]"], "three trunk layer indices"),
                           (["layers=[3,2,1]"], "must be in order"),
                           (["unroll=0"], "unroll=0 must be a positive integer"),
                           (["minutes=0"], "minutes=0.0 must be > 0"),
                           (["data=[]"], "data=\\[...\\] must name")):
        with pytest.raises(ValueError, match=message):
            parse_args(base + extra)
    with pytest.raises(ValueError, match="data=... is required"):
        parse_args(["checkpoint=x"])
