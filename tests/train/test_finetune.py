"""Heads for a trained model: growing a checkpoint, Medusa-1 freezing, Medusa-2 LR groups."""

import json
import os
import shutil
import socket
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import recite  # tests/ is on the path: the shared tiny-model trainer
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

import mtp
from mtp.checkpoint import export, export_hf
from mtp.generate import DrafterSpec, generate
from mtp.interop.hf import HEADS_LAYOUT_FILE
from mtp.model import MTPConfig, MTPModel
from mtp.paths import REPO_ROOT
from mtp.tokenizers import ByteTokenizer
from mtp.train.finetune import grow_heads, grown_config
from mtp.train.lit import MTPLitModule
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.parallel import end_spawned_rank, parallelize
from mtp.train.run import check_settings, compose, train
from mtp.train.settings import InitSettings, OptimSettings, RunSettings, TrainSettings

SEQ_LEN = 16


def _base(n_future: int = 1, head_type: str = "block") -> MTPModel:
    """A 'trained' base model: random weights, perturbed so that no two heads agree."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=n_future, head_type=head_type)
    return MTPModel(config)


def test_grown_config_keeps_the_architecture_and_refuses_silent_drops():
    base = _base(n_future=2).config
    grown = grown_config(base, n_future=5, head_type="block")
    assert (grown.n_future, grown.n_layers, grown.dim) == (5, base.n_layers, base.dim)
    with pytest.raises(ValueError, match=r"n_future=1 is below the checkpoint's 2 heads.*"
                                         r"init.drop_heads=true"):
        grown_config(base, n_future=1, head_type="block")
    assert grown_config(base, n_future=1, head_type="block", drop_heads=True).n_future == 1
    with pytest.raises(ValueError, match=r"head_type='resblock' differs .*heads 1..1 \('block'\)"):
        grown_config(base, n_future=4, head_type="resblock")
    assert grown_config(_base().config, n_future=4, head_type="resblock").n_blocks == 3


@pytest.mark.parametrize("head_type", ["block", "resblock", "linear", "medusa"])
@torch.no_grad()
def test_copied_heads_start_as_head_0_or_the_identity(head_type):
    base = _base()
    config = grown_config(base.config, n_future=3, head_type=head_type)
    model = MTPModel(config)
    model.load_state_dict(grow_heads(base, config, new_heads="copy"))
    tokens = torch.randint(0, 262, (2, 9))
    torch.testing.assert_close(model(tokens)[:, :, 0], base(tokens)[:, :, 0], rtol=0, atol=0)
    trunk = model.trunk(tokens)
    expected = {"block": model.head(trunk, 0), "medusa": model.norm(model.head(trunk, 0))}.get(
        head_type, trunk)  # medusa heads read the base model's final (normed) hidden state
    for i in (1, 2):
        torch.testing.assert_close(model.head(trunk, i), expected, rtol=0, atol=0)
    if head_type in ("block", "medusa"):  # every new head first predicts what head 0 does
        logits = model(tokens)
        torch.testing.assert_close(logits[:, :, 1:], logits[:, :, :1].expand_as(logits[:, :, 1:]),
                                   rtol=0, atol=0)
    random = MTPModel(config)
    random.load_state_dict(grow_heads(base, config, new_heads="random"))
    assert not torch.equal(random.head(trunk, 1), expected)
    with pytest.raises(ValueError, match="init.new_heads='zeros'"):
        grow_heads(base, config, new_heads="zeros")


def _blocks(n_future: int) -> list[dict[str, torch.Tensor]]:
    stream = torch.tensor(list(b"def add(a, b):\n    return a + b\n\n" * 40))
    width = SEQ_LEN + n_future
    return [{"tokens": stream[i:i + width]} for i in range(0, len(stream) - width, SEQ_LEN)]


def _fit(lit: MTPLitModule, steps: int, callbacks: list[L.Callback] = ()) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=list(callbacks),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(lit, DataLoader(_blocks(lit.config.n_future), batch_size=4))
    return trainer


def _grown(head_type: str = "resblock", *, max_steps: int, **optim: object
           ) -> tuple[MTPModel, MTPLitModule]:
    base = _base()
    config = grown_config(base.config, n_future=3, head_type=head_type)
    settings = TrainSettings(run=RunSettings(seq_len=SEQ_LEN, max_steps=max_steps),
                             optim=OptimSettings(lr=1e-2, warmup_steps=1, **optim),
                             init=InitSettings(init_from="the base model above"))
    lit = MTPLitModule(config, settings, init_state=grow_heads(base, config))
    return base, lit


@torch.no_grad()
def test_new_sequential_modules_copy_the_last_module_or_head_0s_blocks():
    base = _base()
    config = grown_config(base.config, n_future=3, head_type="sequential")
    grown = MTPModel(config)
    grown.load_state_dict(grow_heads(base, config))
    for k in (1, 2):  # from a next-token model: head 0's blocks, a fresh fusion
        for name, tensor in base.heads[0][0].state_dict().items():
            assert torch.equal(grown.heads[k][0].state_dict()[name], tensor), name
        assert torch.equal(grown.heads[k].hnorm, torch.ones(32))
        assert not torch.equal(grown.heads[1].eh_proj, torch.zeros(32, 64))
    # from a model with modules: each new one is a copy of the last (MiMo grows its layer so)
    bigger = grown_config(config, n_future=5, head_type="sequential")
    state = grow_heads(grown, bigger)
    for name, tensor in grown.heads[2].state_dict().items():
        for k in (3, 4):
            assert torch.equal(state[f"heads.{k}.{name}"], tensor), (k, name)
    with pytest.raises(ValueError, match=r"model.n_future=5 is above the checkpoint's 3 head\(s\): "
                                         r"set init.new_heads"):
        grown_config(config, n_future=5, head_type="sequential", new_heads=None)
    with pytest.raises(ValueError, match=r"head_type='block' differs .*\('sequential'\)"):
        grown_config(config, n_future=4, head_type="block")


@pytest.mark.parametrize("head_type", ["block", "resblock", "sequential"])
def test_medusa1_trains_the_new_heads_only(head_type):
    base, lit = _grown(head_type, max_steps=4, freeze_trunk=True)
    trainer = _fit(lit, 4)
    model, initial = lit.model, grow_heads(base, lit.config)
    state = {id(p) for p in trainer.optimizers[0].state}
    for name, param in model.named_parameters():
        if MTPModel.is_base_parameter(name):
            assert not param.requires_grad and param.grad is None, name
            assert id(param) not in state, name  # no optimizer state
            assert torch.equal(param, base.state_dict()[name]), name
        else:
            assert id(param) in state, name
            assert not torch.equal(param, initial[name]), name  # the new heads trained
    tokens = torch.randint(0, 262, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :, 0], base(tokens)[:, :, 0],
                                   rtol=0, atol=0)


def test_medusa2_trains_the_base_at_its_multiplier_after_the_heads_only_warm_up():
    base, lit = _grown(max_steps=6, trunk_lr_mult=0.25, heads_only_steps=2)
    lrs, after_warm_up = [], {}

    class Record(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
            lrs.append({g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups})

        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == 2:
                after_warm_up.update({n: p.detach().clone()
                                      for n, p in lit.model.named_parameters()})

    _fit(lit, 6, callbacks=[Record()])
    # Warm-up: the base's rate stays 0 and nothing changes it; then it trains at 0.25x.
    assert [lr["base"] for lr in lrs[:2]] == [0.0, 0.0] and lrs[0]["heads"] > 0
    assert all(lr["base"] > 0 for lr in lrs[2:])
    for name, param in after_warm_up.items():
        if MTPModel.is_base_parameter(name):
            assert torch.equal(param, base.state_dict()[name]), name
    assert not torch.equal(lit.model.layers[0].attention.wq.weight,
                           base.layers[0].attention.wq.weight)


def test_joint_training_uses_the_configured_groups():
    _, lit = _grown("block", max_steps=10, trunk_lr_mult=0.1)
    lit.configure_model()
    lit.trainer = L.Trainer(max_steps=10, logger=False)
    optimizer = lit.configure_optimizers()["optimizer"]
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"heads", "heads_no_decay", "base", "base_no_decay"}
    assert groups["base"]["lr"] == pytest.approx(0.1 * groups["heads"]["lr"])
    assert groups["heads"]["lr"] == pytest.approx(1e-2)
    assert groups["base_no_decay"]["weight_decay"] == 0.0
    named = {id(p): n for n, p in lit.model.named_parameters()}
    assert all(named[id(p)].startswith("heads.") and not named[id(p)].startswith("heads.0.")
               for p in groups["heads"]["params"])
    counted = sum(len(g["params"]) for g in optimizer.param_groups)
    assert counted == len(list(lit.model.parameters()))


def test_a_frozen_trunk_with_a_trunk_group_is_refused():
    with pytest.raises(ValueError, match="trunk_lr_mult=0.1 .*could train it"):
        OptimSettings(freeze_trunk=True, trunk_lr_mult=0.1)
    for overrides, message in [
        (["+experiment=medusa1", "init_from=x", "optim.trunk_lr_mult=0.5"],
         "freeze_trunk=true with optim.trunk_lr_mult=0.5"),
        (["+experiment=medusa1", "init_from=x", "optim.heads_only_steps=10"],
         "heads_only_steps=10: a frozen trunk"),
        (["+experiment=medusa1"], "freeze_trunk=true needs init_from"),
        (["+experiment=medusa2", "init_from=x", "optim.heads_only_steps=400"],
         r"heads_only_steps=400 must be in \[0, trainer.max_steps=400\)"),
        (["init_from=x", "init.new_heads=zeros"], "init.new_heads='zeros'"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_settings(compose([*overrides, "run_dir=/tmp/unused"]))


# -- python -m mtp.train +experiment=medusa1 init_from=... end to end ------------------------


@pytest.fixture(scope="module")
def base_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = MTPConfig.compute_matched(depth=4, vocab_size=262, dim=32, n_heads=4,
                                       max_seq_len=128)
    return export(MTPModel(config), ByteTokenizer(), tmp_path_factory.mktemp("base") / "export")


def _overrides(tmp_path: Path, base: Path, *extra: str) -> list[str]:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for path in sorted((REPO_ROOT / "mtp").glob("*.py"))[:6]:
        shutil.copy(path, corpus / path.name)
    return ["+experiment=medusa1", f"init_from={base}", "data=local",
            f"data.source.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}",
            "data.val_fraction=0.3", "data.batch_size=4", "seq_len=32", "logger=none",
            "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
            "optim.warmup_steps=1", "trainer.precision=32-true", "trainer.max_steps=3",
            "trainer.val_check_interval=3", f"run_dir={tmp_path / 'run'}", *extra]


def test_medusa1_end_to_end_keeps_head_0_and_records_the_head_type(tmp_path: Path,
                                                                    base_export: Path) -> None:
    export_dir = train(compose(_overrides(tmp_path, base_export)))
    model, tokenizer = mtp.load(export_dir)
    base, _ = mtp.load(base_export)
    assert (model.config.n_future, model.config.head_type) == (4, "resblock")
    tokens = torch.tensor([tokenizer.encode("def f(x):\n    return")])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :, 0], base(tokens)[:, :, 0], rtol=0, atol=0)
    assert not torch.equal(model.heads[1][0].weight, torch.zeros(32, 32))


def test_medusa2_end_to_end_trains_the_base_too(tmp_path: Path, base_export: Path) -> None:
    cfg = compose(_overrides(tmp_path, base_export, "optim.heads_only_steps=1")[1:]
                  + ["+experiment=medusa2"])
    assert list(cfg.loss.weights) == pytest.approx([1, 0.8, 0.64, 0.512])
    model, _ = mtp.load(train(cfg))
    base, _ = mtp.load(base_export)
    assert not torch.equal(model.layers[0].attention.wq.weight,
                           base.layers[0].attention.wq.weight)


@pytest.mark.parametrize("extra, message", [
    (["tokenizer=bpe"], r"has a byte tokenizer \(vocab_size=262\) but tokenizer=bpe"),
    (["model.vocab_size=300"], "model.vocab_size=300 does not match"),
    (["model.n_future=1"], "leaves nothing to train"),
])
def test_init_from_mismatches_fail_before_training(tmp_path: Path, base_export: Path,
                                                   extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(compose(_overrides(tmp_path, base_export, *extra)))
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- decoding and export with every head type ------------------------------------------------

DOCS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def next_token_model() -> MTPModel:
    torch.manual_seed(0)
    model = MTPModel(MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=96))
    recite(model, DOCS, 100)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["block", "resblock", "linear", "medusa", "sequential"])
def test_medusa1_heads_draft_for_greedy_speculative_decoding(next_token_model: MTPModel,
                                                             head_type: str,
                                                             tmp_path: Path) -> None:
    """Heads grown on a trained model: exported and loaded, greedy speculative decoding with
    them equals autoregressive decoding token for token, and they draft useful tokens."""
    config = grown_config(next_token_model.config, n_future=4, head_type=head_type)
    model = MTPModel(config)
    model.load_state_dict(grow_heads(next_token_model, config))
    for name, param in model.named_parameters():
        param.requires_grad_(not MTPModel.is_base_parameter(name))
    recite(model, DOCS, 60)
    with torch.no_grad():  # the base model's own logits, bit for bit
        tokens = torch.tensor([list(b"def add(a, b):")])
        torch.testing.assert_close(model(tokens, heads=[0]), next_token_model(tokens, heads=[0]),
                                   rtol=0, atol=0)
    export(model, ByteTokenizer(), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["head_type"] == head_type
    loaded, tokenizer = mtp.load(tmp_path, dtype=torch.float64)
    prompts = ["def add(", "for i", "zzz"]
    reference = generate(loaded, tokenizer, prompts, max_new_tokens=40)
    assert reference[0].text == "a, b):\n    return a + b\n"  # head 0 is the base model's
    for k in (2, 4):
        generations = generate(loaded, tokenizer, prompts, max_new_tokens=40,
                               drafter=DrafterSpec(drafter="heads", k=k))
        assert [g.token_ids for g in generations] == [g.token_ids for g in reference], k
    trees = generate(loaded, tokenizer, prompts, max_new_tokens=40,
                     drafter=DrafterSpec(drafter="heads", tree="tree8"))
    assert [g.token_ids for g in trees] == [g.token_ids for g in reference]
    assert generations[0].stats.tokens_per_forward > 1.25  # random heads: about 1


@pytest.mark.parametrize("head_type", ["resblock", "linear", "medusa", "sequential"])
def test_hugging_face_export_records_the_head_type_and_loads_back(tmp_path: Path,
                                                                   head_type: str) -> None:
    config = grown_config(_base().config, n_future=3, head_type=head_type)
    model = MTPModel(config).eval()
    export_hf(model, ByteTokenizer(), tmp_path)
    layout = json.loads((tmp_path / HEADS_LAYOUT_FILE).read_text())
    assert (layout["layout"], layout["n_future"]) == (head_type, 3)
    loaded, _ = mtp.load(tmp_path)
    assert loaded.config == config
    tokens = torch.randint(0, 262, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=1e-5)


# -- FSDP2 on 2 CPU ranks --------------------------------------------------------------------


def _fsdp_worker(rank: int, port: int, results: dict, head_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        config = grown_config(_base().config, n_future=3, head_type=head_type)
        reference = MTPModel(config)
        for name, param in reference.named_parameters():
            param.requires_grad_(not MTPModel.is_base_parameter(name))
        tokens = torch.randint(0, 262, (4, 16 + 3))
        mtp_loss(reference, tokens, backward=autograd_backward)
        sharded = MTPModel(config)
        sharded.load_state_dict(reference.state_dict())
        for name, param in sharded.named_parameters():
            param.requires_grad_(not MTPModel.is_base_parameter(name))
        parallelize(sharded, init_device_mesh("cpu", (2,)))
        mtp_loss(sharded, tokens.chunk(2)[rank], backward=autograd_backward)
        grads = {name: None if p.grad is None else p.grad.full_tensor()
                 for name, p in sharded.named_parameters()}
        if rank == 0:
            results.update({name: (grad, p.grad) for (name, p), grad in
                            zip(reference.named_parameters(), grads.values())})
        end_spawned_rank()
    finally:  # reached only when the work above raised
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["resblock", "medusa"])  # medusa heads call the norm
def test_fsdp_medusa1_resblock_heads_match_one_process(head_type: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_fsdp_worker, args=(port, results, head_type), nprocs=2, join=True)
    assert len(results) == len(list(MTPModel(grown_config(
        _base().config, n_future=3, head_type=head_type)).parameters()))
    for name, (sharded, single) in dict(results).items():
        if MTPModel.is_base_parameter(name):
            assert sharded is None and single is None, name
        else:
            torch.testing.assert_close(sharded, single, rtol=1e-5, atol=1e-6, msg=name)
