"""Every preset composes (Hydra), and the composed model configs are the intended shapes."""

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from mtp.paths import CONF_DIR
from mtp.tokenizers import ByteTokenizer
from mtp.train import build_trainer, check_settings, compose, model_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONF_DIR / "trainer").glob("*.yaml"))
LOGGERS = sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml"))
HEADS = {"byte8": 8, "byte1": 1, "bpe4": 4, "ntp": 1, "medusa1": 4, "medusa2": 4,
         "smollm2_medusa1": 4}
TOKENIZERS = {"bpe4": "bpe", "ntp": "bpe", "smollm2_medusa1": "bpe"}  # the others: byte
# Medusa experiments start from a checkpoint; composing and checking them reads none.
NEEDS_INIT = {name: ["init_from=/unused/export"]
              for name in ("medusa1", "medusa2", "smollm2_medusa1")}


def test_the_documented_presets_exist() -> None:
    assert set(HEADS) <= set(EXPERIMENTS)
    assert {"tiny", "small", "1b", "7b"} <= set(MODELS)
    assert {"cpu", "gpu", "fsdp"} <= set(TRAINERS)
    assert {"wandb", "csv", "none"} <= set(LOGGERS)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_and_model_composes(experiment: str, model: str) -> None:
    cfg = compose([f"+experiment={experiment}", f"model={model}", "run_dir=/tmp/unused",
                   *NEEDS_INIT.get(experiment, [])])
    OmegaConf.resolve(cfg)
    check_settings(cfg)
    config = model_config(cfg, ByteTokenizer())  # the vocabulary only scales the embeddings
    assert config.n_future == HEADS.get(experiment, config.n_future)
    # Compute matched: a token goes through `depth` blocks whatever the number of heads.
    assert config.n_blocks == cfg.model.depth
    assert cfg.tokenizer.kind == TOKENIZERS.get(experiment, "byte")


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("logger", LOGGERS)
def test_trainer_and_logger_presets_compose(trainer: str, logger: str) -> None:
    cfg = compose([f"trainer={trainer}", f"logger={logger}", "run_dir=/tmp/unused",
                   "trainer.devices=2"])
    OmegaConf.resolve(cfg)
    if trainer == "fsdp":
        assert cfg.trainer.strategy.data_parallel_size == 2  # num_nodes * devices
        assert cfg.trainer.strategy.tensor_parallel_size == 1


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_preset_instantiates_a_lightning_trainer(trainer: str,
                                                                tmp_path: Path) -> None:
    overrides = [f"trainer={trainer}", f"run_dir={tmp_path}"]
    if OmegaConf.load(CONF_DIR / "trainer" / f"{trainer}.yaml").get("strategy") is not None:
        overrides.append("trainer.devices=2")  # a sharded preset: two ranks (none started here)
    if not torch.cuda.is_available():
        overrides.append("trainer.accelerator=cpu")  # the GPU presets, everything else as is
    cfg = compose(overrides)
    built = build_trainer(cfg, logger=False, enable_checkpointing=False)
    assert isinstance(built, L.Trainer)
    assert built.max_steps == cfg.trainer.max_steps
    assert str(built.precision) == str(OmegaConf.to_container(cfg.trainer, resolve=True)[
        "precision"])


def test_paper_scale_run_keeps_the_experiment_heads() -> None:
    cfg = compose(["+experiment=byte8", "model=7b", "trainer=fsdp", "trainer.num_nodes=4",
                   "trainer.devices=8", "run_dir=/tmp/unused"])
    OmegaConf.resolve(cfg)
    assert (cfg.model.dim, cfg.model.n_heads, cfg.model.ffn_hidden, cfg.model.depth) == (
        4096, 32, 11008, 32)
    assert cfg.model.n_future == 8
    assert cfg.trainer.strategy.data_parallel_size == 32


def test_command_line_overrides_reach_the_model() -> None:
    cfg = compose(["+experiment=byte8", "model.n_future=4", "trainer.max_steps=7",
                   "run_dir=/tmp/unused"])
    assert model_config(cfg, ByteTokenizer()).n_future == 4
    assert cfg.trainer.max_steps == 7


@pytest.mark.parametrize("experiment", ["byte8", "bpe4", "medusa1", "medusa2"])
def test_sequential_heads_compose_with_the_experiments(experiment: str) -> None:
    """model.head_type=sequential on a preset: the same blocks per token (its modules are
    blocks, taken off the trunk as block heads are) and the same loss weights."""
    cfg = compose([f"+experiment={experiment}", "model.head_type=sequential",
                   "run_dir=/tmp/unused", *NEEDS_INIT.get(experiment, [])])
    OmegaConf.resolve(cfg)
    check_settings(cfg)
    config = model_config(cfg, ByteTokenizer())
    assert config.head_type == "sequential" and config.n_blocks == cfg.model.depth
    assert config.n_future == HEADS[experiment]


def test_unknown_experiment_is_hydras_error() -> None:
    with pytest.raises(ConfigCompositionException, match="byte9"):
        compose(["+experiment=byte9"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["seq_len=2048"], r"seq_len=2048 must be .*model\.max_seq_len=1024"),
    (["+experiment=byte8", "loss.weights=[1,1]"], r"loss\.weights=\[1, 1\] .*model\.n_future=8"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1"),
])
def test_inconsistent_settings_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_settings(compose([*overrides, "run_dir=/tmp/unused"]))


def test_explicit_vocab_size_must_match_the_tokenizer() -> None:
    cfg = compose(["model.vocab_size=32000", "run_dir=/tmp/unused"])
    with pytest.raises(ValueError, match="model.vocab_size=32000 .*tokenizer=byte's vocab_size=262"):
        model_config(cfg, ByteTokenizer())


def test_cli_prints_the_composed_job() -> None:
    out = subprocess.run([sys.executable, "-m", "mtp.train", "+experiment=byte8", "--cfg", "job"],
                         capture_output=True, text=True, check=True, cwd=CONF_DIR.parent)
    job = OmegaConf.create(out.stdout)
    assert job.model.n_future == 8 and job.tokenizer.kind == "byte"
