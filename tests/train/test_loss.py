import weakref

import pytest
import torch
import torch.nn.functional as F

from mtp.model import HEAD_TYPES, MTPConfig, MTPModel
from mtp.train.loss import IGNORE_INDEX, autograd_backward, mtp_loss, shift_targets
from mtp.train.schedule import Progress
from mtp.train.settings import LossSettings


def test_shift_targets_worked_example():
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    inputs, targets = shift_targets(tokens, seq_len=3, n_future=2)
    assert inputs.tolist() == [[10, 11, 12]]
    assert targets.tolist() == [[[11, 12, 13], [12, 13, 14]]]


def test_shift_targets_ignores_targets_past_the_end():
    inputs, targets = shift_targets(torch.tensor([[10, 11, 12, 13]]), seq_len=3, n_future=2)
    assert inputs.tolist() == [[10, 11, 12]]
    assert targets.tolist() == [[[11, 12, 13], [12, 13, IGNORE_INDEX]]]
    _, targets = shift_targets(torch.tensor([[1, 2, 3]]), seq_len=3, n_future=3)
    assert targets.tolist() == [[[2, 3, -100], [3, -100, -100], [-100, -100, -100]]]


@pytest.mark.parametrize("seq_len", [0, 6])
def test_shift_targets_rejects_impossible_lengths(seq_len):
    with pytest.raises(ValueError, match=f"seq_len={seq_len}"):
        shift_targets(torch.zeros(1, 5, dtype=torch.long), seq_len, 2)


def _gradients(model: MTPModel, tokens: torch.Tensor, **kwargs) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    out = mtp_loss(model, tokens, backward=autograd_backward, **kwargs)
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("n_future,head_type", [
    (1, "block"), (2, "block"), (4, "block"), (8, "block"), (4, "resblock"), (4, "linear"),
    (4, "medusa"), (2, "sequential"), (5, "sequential")])
def test_naive_headwise_and_chunked_give_equal_losses_and_gradients(n_future, head_type):
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=n_future, head_type=head_type)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 12 + n_future))
    weights = [1.0 / (i + 1) for i in range(n_future)]
    naive, naive_grads = _gradients(model, tokens, mode="naive", weights=weights)
    for mode in ("headwise", "chunked"):
        out, grads = _gradients(model, tokens, mode=mode, weights=weights, chunk_size=5)
        torch.testing.assert_close(out.loss, naive.loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.head_losses, naive.head_losses, rtol=1e-12, atol=1e-12)
        assert torch.equal(out.head_correct, naive.head_correct)
        assert grads.keys() == naive_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, naive_grads[name], rtol=1e-10, atol=1e-12,
                                       msg=f"{mode}: gradient of {name}")
    assert all(g.abs().sum() > 0 for g in naive_grads.values())


@pytest.mark.parametrize("mode", ["headwise", "chunked"])
@pytest.mark.parametrize("head_type", ["block", "sequential"])
def test_a_heads_logits_are_freed_before_its_backward(mode, head_type, monkeypatch):
    """What keeps a step's memory O(V + d): no (N, V) logits outlive their scoring, so a
    head's backward never holds them beside their gradient."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=3, head_type=head_type)
    model = MTPModel(config)
    logits: list[weakref.ref] = []
    unembed = model.unembed

    def recorded(*args, **kwargs):
        out = unembed(*args, **kwargs)
        logits.append(weakref.ref(out))
        return out

    def backward(tensor, grad=None):
        assert all(ref() is None for ref in logits), "logits alive during a backward"
        autograd_backward(tensor, grad)

    monkeypatch.setattr(model, "unembed", recorded)
    mtp_loss(model, torch.randint(0, 262, (2, 12 + 3)), mode=mode, chunk_size=5,
             backward=backward)
    assert len(logits) >= 3


def test_one_head_is_the_plain_language_model_loss():
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (3, 17))
    logits = model(tokens[:, :-1])[:, :, 0]  # (B, T, V)
    expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    for mode in ("naive", "headwise", "chunked"):
        out = mtp_loss(model, tokens, mode=mode)
        torch.testing.assert_close(out.loss, expected)
        assert out.head_count.tolist() == [3 * 16]


def test_accuracy_counts_top1_hits_on_real_targets_only(tiny_config):
    model = MTPModel(tiny_config)
    tokens = torch.randint(0, 262, (2, 10))
    out = mtp_loss(model, tokens, seq_len=8, mode="naive")  # heads 2, 3 run out of targets
    assert out.head_count.tolist() == [16, 16, 14, 12]
    inputs, targets = shift_targets(tokens, 8, 4)
    with torch.no_grad():
        predictions = model(inputs).argmax(-1).permute(0, 2, 1)  # (B, n, T)
    hits = ((predictions == targets) & (targets != IGNORE_INDEX)).sum(dim=(0, 2))
    assert out.head_correct.tolist() == hits.tolist()


def test_zero_weight_head_gets_no_gradient(tiny_config):
    model = MTPModel(tiny_config)
    mtp_loss(model, torch.randint(0, 262, (2, 12)), weights=[1, 1, 0, 1],
             backward=autograd_backward)
    assert all(p.grad.abs().sum() == 0 for p in model.heads[2].parameters())
    assert all(p.grad.abs().sum() > 0 for p in model.heads[3].parameters())


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="fast"), "loss.mode='fast' is not one of"),
    (dict(weights=[1.0, 0.5]), r"loss.weights=\[1.0, 0.5\] needs one weight per head "
                               r"\(model.n_future=4\)"),
    (dict(weights=[1.0, -1.0, 1.0, 1.0]), r"loss.weights=\[1.0, -1.0, 1.0, 1.0\] must be a "
                                          r"list of numbers in \[0, 1\]"),
    (dict(weights=[1.0, 2.0, 1.0, 1.0]), r"must be a list of numbers in \[0, 1\]"),
    (dict(ahead=[0.5, 1.5]), r"loss.ahead=\[0.5, 1.5\] must be a list of numbers in \[0, 1\]"),
    (dict(chunk_size=0), "chunk_size=0 must be >= 1"),
    (dict(schedule="cosine"), "loss.schedule='cosine' is not one of"),
    (dict(schedule="stepped"), r"loss.schedule=stepped needs loss.schedule_steps=\[STEP\]"),
    (dict(schedule="stepped", schedule_steps=[10], schedule_factor=2.0),
     r"loss.schedule_factor=2.0 must be in \[0, 1\]"),
    (dict(schedule="anneal", schedule_steps=[10, 5]),
     r"loss.schedule=anneal takes loss.schedule_steps=\[START, END\] with START < END"),
    (dict(schedule="ramp", schedule_steps=[-1, 5]),
     r"loss.schedule_steps=\[-1, 5\] must be a list of optimizer steps >= 0"),
])
def test_bad_loss_arguments_are_named(tiny_config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mtp_loss(MTPModel(tiny_config), torch.zeros(1, 8, dtype=torch.long), **kwargs)


@pytest.mark.parametrize("chunk_size, head_type", [(1, "block"), (2, "block"), (16, "block"),
                                                   (2, "sequential"), (16, "sequential")])
def test_chunked_loss_with_ignore_index_targets_equals_naive(chunk_size, head_type):
    """Blocks one look-ahead token long: heads 1..3 lose targets to ignore_index, head 3 has
    none at all, and with small chunks whole chunks hold only ignore_index targets. Sequential
    modules then read token 0 where the block has no look-ahead token left: only ignored
    targets depend on it."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=4, head_type=head_type)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 4))  # seq_len 3 + 1 look-ahead token
    naive, naive_grads = _gradients(model, tokens, seq_len=3, mode="naive")
    chunked, grads = _gradients(model, tokens, seq_len=3, mode="chunked", chunk_size=chunk_size)
    assert naive.head_count.tolist() == chunked.head_count.tolist() == [6, 4, 2, 0]
    assert chunked.head_losses[3] == 0 and chunked.head_losses[:3].gt(0).all()
    torch.testing.assert_close(chunked.loss, naive.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.head_losses, naive.head_losses, rtol=1e-12, atol=1e-12)
    assert torch.equal(chunked.head_correct, naive.head_correct)
    assert all(p.grad.abs().sum() == 0 for p in model.heads[3].parameters())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, naive_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def _freeze_base(model: MTPModel) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(not MTPModel.is_base_parameter(name))


@pytest.mark.parametrize("head_type", ["resblock", "sequential"])
@pytest.mark.parametrize("mode", ["naive", "headwise", "chunked"])
def test_a_frozen_base_gets_no_gradient_and_no_trunk_backward(mode, head_type):
    """Medusa-1: only heads 1..n-1 train, and nothing runs backward through the trunk."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64,
                       n_future=3, head_type=head_type)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 15))
    _, reference = _gradients(model, tokens, mode="naive")
    _freeze_base(model)
    trunk_outputs = []
    model.layers[-1].register_forward_hook(lambda module, args, out: trunk_outputs.append(out))
    model.zero_grad(set_to_none=True)
    out = mtp_loss(model, tokens, mode=mode, backward=autograd_backward, chunk_size=5)
    assert out.head_losses.shape == (3,) and torch.isfinite(out.head_losses).all()
    assert trunk_outputs and not any(t.requires_grad for t in trunk_outputs)  # no graph at all
    for name, param in model.named_parameters():
        if MTPModel.is_base_parameter(name):
            assert param.grad is None, name
        else:  # the heads' gradients do not depend on the base being frozen
            torch.testing.assert_close(param.grad, reference[name], rtol=1e-10, atol=1e-12)


def test_train_trunk_false_backpropagates_into_the_heads_only(tiny_config):
    model = MTPModel(tiny_config).double()
    tokens = torch.randint(0, 262, (2, 12))
    _, reference = _gradients(model, tokens)
    model.zero_grad(set_to_none=True)
    mtp_loss(model, tokens, backward=autograd_backward, train_trunk=False)
    for name, param in model.named_parameters():
        if name.startswith(("tok_embeddings.", "layers.")):
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, reference[name], rtol=1e-10, atol=1e-12)


def test_sequential_modules_read_the_tokens_ahead_and_never_the_padding():
    """Module k at position t reads token t + k: changing the block's last look-ahead token
    changes only the last position of the last module's output; and the loss of a block one
    token short of look-ahead is the full block's loss over the targets that exist."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=64,
                       n_future=3, head_type="sequential")
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 8 + 3))
    with torch.no_grad():
        trunk = model.trunk(tokens[:, :8])
        before = model.head_states(trunk, tokens, 3)
        changed = tokens.clone()
        changed[:, -2] = (changed[:, -2] + 1) % 262  # token 9 = 7 + 2: module 2 at position 7
        after = model.head_states(trunk, changed, 3)
    torch.testing.assert_close(before[1], after[1], rtol=0, atol=0)
    torch.testing.assert_close(before[2][:, :7], after[2][:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[2][:, 7], after[2][:, 7])
    short = mtp_loss(model, tokens[:, :-1], seq_len=8, mode="naive")
    assert short.head_count.tolist() == [16, 16, 14]
    # the same module outputs where targets exist: the missing token is never read for them
    short_sum = short.head_losses * short.head_count
    inputs, targets = shift_targets(tokens, 8, 3)
    with torch.no_grad():
        logits = torch.stack([model.unembed(s) for s in before], dim=2)  # (B, T, n, V)
    targets[:, 2, -1] = IGNORE_INDEX
    full = [F.cross_entropy(logits[:, :, i].flatten(0, 1), targets[:, i].flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum") for i in range(3)]
    torch.testing.assert_close(short_sum, torch.stack(full))


def test_sequential_modules_under_activation_checkpointing_give_the_same_gradients():
    """`activation_checkpointing=all` is how the chain's backward keeps only each module's
    input: the gradients must not change."""
    from mtp.train.parallel import apply_activation_checkpointing

    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64,
                       n_future=3, head_type="sequential")
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 15))
    _, reference = _gradients(model, tokens, mode="naive")
    apply_activation_checkpointing(model, "all")
    _, grads = _gradients(model, tokens, mode="headwise")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("head_type", ["block", "sequential"])
def test_the_early_exit_adds_head_0_on_the_early_layers_in_every_mode(head_type):
    """LayerSkip's term: the same loss and gradients in every mode, and what autograd gives for
    the sum written out: the heads' losses plus w * CE(head 0 after layers 0..e-1)."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=3, head_type=head_type)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 12 + 3))
    model.zero_grad(set_to_none=True)
    plain = mtp_loss(model, tokens, mode="naive", backward=autograd_backward)
    inputs, targets = shift_targets(tokens, 12, 3)
    exit_logits = model.unembed(model.head(model.trunk(inputs, skip=range(2, 4)), 0))
    exit_ce = F.cross_entropy(exit_logits.flatten(0, 1), targets[:, 0].flatten())
    (0.3 * exit_ce).backward()  # the gradients add to the heads' loss's
    reference_loss = plain.loss + 0.3 * exit_ce.detach()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    naive = None
    for mode in ("naive", "headwise", "chunked"):
        out, grads = _gradients(model, tokens, mode=mode, chunk_size=5, early_exit=2,
                                early_exit_weight=0.3)
        naive = naive or grads
        torch.testing.assert_close(out.loss, reference_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.exit_loss, exit_ce.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.head_losses, plain.head_losses, rtol=1e-12, atol=1e-12)
        assert out.exit_correct == (exit_logits.argmax(-1) == targets[:, 0]).sum()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, naive[name], rtol=1e-10, atol=1e-12,
                                       msg=f"{mode}: gradient of {name}")
            # Against two separate backward passes: float64 attention on a CPU rounds
            # differently (1e-8 relative here) when both terms' gradients reach it at once.
            torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{mode}: gradient of {name}")


@pytest.mark.parametrize("early_exit, weight, message", [
    (0, 1.0, "loss.early_exit=0 must be a trunk layer from 1 to n_layers - 1 "),
    (2, 1.0, "loss.early_exit=2 must be a trunk layer from 1 to n_layers - 1 = 1"),
    (1, -1.0, "loss.early_exit_weight=-1.0 must be >= 0")])
def test_bad_early_exits_are_named(tiny_config, early_exit, weight, message):
    with pytest.raises(ValueError, match=message):
        mtp_loss(MTPModel(tiny_config), torch.zeros(1, 8, dtype=torch.long),
                 early_exit=early_exit, early_exit_weight=weight)


# The weights at given steps of a 400-step run, heads 0..2 with base weights 1, 0.5, 0.25
# (two distances beyond the next token), literal values (mtp/train/schedule.py).
SCHEDULED = [
    (dict(schedule="constant"), {0: (1, 0.5, 0.25), 399: (1, 0.5, 0.25)}),
    # DeepSeek-V3's step: from step 270 on, the extra heads' weights times the factor
    (dict(schedule="stepped", schedule_steps=[270], schedule_factor=0.5),
     {0: (1, 0.5, 0.25), 269: (1, 0.5, 0.25), 270: (1, 0.25, 0.125), 399: (1, 0.25, 0.125)}),
    # reverse curriculum over the run: head 2 falls in [0, 200], then head 1 in [200, 400]
    (dict(schedule="anneal"), {0: (1, 0.5, 0.25), 100: (1, 0.5, 0.125), 200: (1, 0.5, 0),
                               300: (1, 0.25, 0), 400: (1, 0, 0)}),
    # forward curriculum: head 1 rises in [0, 200], then head 2 in [200, 400]
    (dict(schedule="ramp"), {0: (1, 0, 0), 100: (1, 0.25, 0), 200: (1, 0.5, 0),
                             300: (1, 0.5, 0.125), 400: (1, 0.5, 0.25)}),
    # a window: nothing moves before step 100; the anneal is done at step 300
    (dict(schedule="anneal", schedule_steps=[100, 300]),
     {50: (1, 0.5, 0.25), 150: (1, 0.5, 0.125), 250: (1, 0.25, 0), 350: (1, 0, 0)}),
]


@pytest.mark.parametrize("schedule, expected", SCHEDULED, ids=lambda v: str(v)[:40])
def test_each_schedule_gives_its_weights_at_given_steps(schedule, expected):
    settings = LossSettings(weights=[1, 0.5, 0.25], **schedule)
    for step, weights in expected.items():
        at = Progress(step=step, max_steps=400)
        assert settings.head_weights(3, at) == weights, step
        resolved = settings.resolved(3, at, scale=0.5)  # a micro-batch's share
        assert resolved.schedule == "constant" and resolved.head_weights(3) == tuple(
            w / 2 for w in weights)


def test_the_single_head_loss_anneals_to_next_token_prediction():
    """modded-nanogpt: head 0 on t+1, t+2, t+3 weighted 1, 1/2, 1/4, annealed over the first
    3/4 of the run here: [1, 0.5, 0.25 -> 0] -> [1, 0.5 -> 0] -> [1]."""
    settings = LossSettings(ahead=[0.5, 0.25], schedule="anneal", schedule_steps=[0, 300])
    expected = {0: (0.5, 0.25), 75: (0.5, 0.125), 150: (0.5, 0), 225: (0.25, 0), 300: (0, 0),
                399: (0, 0)}
    for step, weights in expected.items():
        at = Progress(step=step, max_steps=400)
        assert settings.ahead_weights(1, at) == weights, step
        assert settings.head_weights(1, at) == (1.0,)
    assert settings.lookahead(1) == 3 and settings.lookahead(8) == 8


def test_a_schedule_follows_the_time_budget_when_it_ends_the_run_first():
    """As the learning rate: progress is max(step / max_steps, elapsed / time_budget)."""
    settings = LossSettings(weights=[1, 0.5, 0.25], schedule="anneal")
    slow = Progress(step=100, max_steps=400, elapsed=30.0, time_budget=60.0)  # half the time
    assert settings.head_weights(3, slow) == (1, 0.5, 0)
    fast = Progress(step=100, max_steps=400, elapsed=6.0, time_budget=60.0)
    assert settings.head_weights(3, fast) == (1, 0.5, 0.125)


@pytest.mark.parametrize("mode", ["naive", "headwise", "chunked"])
def test_the_look_ahead_term_scores_head_0_against_the_tokens_further_ahead(mode):
    """loss.ahead: the same loss and gradients as head 0's cross-entropies against t+1, t+2
    and t+3 written out; the blocks carry 3 look-ahead tokens for a one-head model."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 12 + 3))
    inputs, targets = shift_targets(tokens, 12, 3)
    logits = model(inputs)[:, :, 0].flatten(0, 1)
    ce = [F.cross_entropy(logits, targets[:, d].flatten()) for d in range(3)]
    (ce[0] + 0.5 * ce[1] + 0.25 * ce[2]).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    out, grads = _gradients(model, tokens, mode=mode, ahead=[0.5, 0.25], chunk_size=5)
    torch.testing.assert_close(out.loss, (ce[0] + 0.5 * ce[1] + 0.25 * ce[2]).detach())
    torch.testing.assert_close(out.ahead_losses, torch.stack(ce[1:]).detach())
    assert out.head_losses.shape == (1,) and out.ahead_count.tolist() == [24, 24]
    assert out.ahead_correct.tolist() == [
        (logits.argmax(-1) == targets[:, d].flatten()).sum().item() for d in (1, 2)]
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_added_heads_give_equal_gradients_in_every_mode(head_type):
    """Heads on top of a full-depth trunk (model.heads=added), weighted as a schedule has
    them mid-run: naive, headwise and chunked give the same losses and gradients."""
    config = MTPConfig.from_depth(depth=3, heads="added", n_future=4, head_type=head_type,
                                  vocab_size=262, dim=32, n_heads=4, n_kv_heads=2,
                                  max_seq_len=64)
    assert config.n_layers + config.head_layers == 3  # head 0 reads every block of depth
    model = MTPModel(config).double()
    tokens = torch.randint(0, 262, (2, 12 + 4))
    scheduled = LossSettings(weights=[1, 0.5, 0.5, 0.5], schedule="anneal")
    weights = scheduled.head_weights(4, Progress(step=2, max_steps=8))
    assert weights == pytest.approx((1, 0.5, 0.5, 0.125))  # head 3 is on its way down
    naive, naive_grads = _gradients(model, tokens, mode="naive", weights=weights)
    for mode in ("headwise", "chunked"):
        out, grads = _gradients(model, tokens, mode=mode, weights=weights, chunk_size=5)
        torch.testing.assert_close(out.loss, naive.loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.head_losses, naive.head_losses, rtol=1e-12, atol=1e-12)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, naive_grads[name], rtol=1e-10, atol=1e-12,
                                       msg=f"{mode}: gradient of {name}")
    assert all(naive_grads[name].abs().sum() > 0 for name, _ in model.named_parameters()
               if name.startswith("heads.3."))
