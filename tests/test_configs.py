"""Every preset composes (Hydra), and the composed model configs are the intended shapes."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mtp.data import InstalledSource, StdlibSource
from mtp.model import MTPModel
from mtp.paths import CONF_DIR
from mtp.paths import mbpp_file as mbpp_data_file
from mtp.tokenizers import ByteTokenizer
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.optim import build_optimizer
from mtp.train.run import CONTEXT, build_trainer, check_settings, compose, model_config
from mtp.train.settings import OptimSettings, TrainSettings

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONF_DIR / "trainer").glob("*.yaml"))
LOGGERS = sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml"))
HEADS = {"byte8": 8, "byte1": 1, "bpe4": 4, "ntp": 1, "medusa1": 4, "medusa2": 4,
         "smollm2_medusa1": 4, "byte8_added": 8, "byte8_light": 8, "byte8_stepped": 8,
         "byte8_anneal": 8, "byte8_ramp": 8, "byte1_ahead": 1, "heads_finish": 8}
TOKENIZERS = {"bpe4": "bpe", "ntp": "bpe", "smollm2_medusa1": "bpe"}  # the others: byte
# Medusa experiments start from a checkpoint; composing and checking them reads none.
NEEDS_INIT = {name: ["init_from=/unused/export"]
              for name in ("medusa1", "medusa2", "smollm2_medusa1", "heads_finish")}


def test_the_documented_presets_exist() -> None:
    assert set(HEADS) <= set(EXPERIMENTS)
    assert {"tiny", "small", "50m", "150m", "400m", "1b", "7b"} <= set(MODELS)
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
    if cfg.model.heads == "matched":  # a token goes through `depth` blocks whatever the heads
        assert config.n_blocks == cfg.model.depth
    else:  # added: head 0 reads `depth` blocks, the other heads come on top
        assert config.n_layers + config.head_layers == cfg.model.depth
    assert cfg.tokenizer.kind == TOKENIZERS.get(experiment, "byte")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("trainer", ["gpu", "fsdp"])
def test_every_model_composes_with_the_gpu_recipes(trainer: str, model: str) -> None:
    cfg = compose(["+experiment=byte8", f"trainer={trainer}", f"model={model}",
                   "run_dir=/tmp/unused"])
    OmegaConf.resolve(cfg)
    check_settings(cfg)  # seq_len is the model's context
    config = model_config(cfg, ByteTokenizer())
    assert config.n_future == 8 and cfg.seq_len == config.max_seq_len
    assert cfg.optim.lr == pytest.approx(1e-3 * 512 / config.dim)


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
    if compose(overrides).trainer.get("strategy") is not None:
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


def test_the_cpu_default_recipe_is_unchanged() -> None:
    """`+experiment=byte8`: the 9.8M model, 400 steps of 16 x 256 bytes, 14-minute guard."""
    cfg = compose(["+experiment=byte8", "run_dir=/tmp/unused"])
    OmegaConf.resolve(cfg)
    config = model_config(cfg, ByteTokenizer())
    assert (config.dim, config.n_layers, config.n_future, config.max_seq_len) == (256, 4, 8, 1024)
    assert MTPModel(config).num_params() == 9_774_336
    assert (cfg.seq_len, cfg.data.batch_size, cfg.optim.lr, cfg.optim.warmup_steps) == (
        256, 16, 3e-3, 50)
    assert (cfg.trainer.accelerator, cfg.trainer.max_steps, cfg.trainer.max_time) == (
        "cpu", 400, "00:00:14:00")
    assert cfg.compile is False and cfg.checkpoint.every_n_steps == 100
    assert isinstance(instantiate(cfg.data.source), StdlibSource)
    assert (cfg.decode.prompts, cfg.decode.max_new_tokens, list(cfg.decode.trees)) == (
        4, 64, ["tree16"])


@pytest.mark.parametrize("trainer", ["gpu", "fsdp"])
def test_gpu_recipes_size_the_run_for_the_device(trainer: str) -> None:
    cfg = compose(["+experiment=byte8", f"trainer={trainer}", "run_dir=/tmp/unused"])
    OmegaConf.resolve(cfg)
    config = model_config(cfg, ByteTokenizer())
    assert (config.dim, config.n_blocks, config.n_future) == (512, 16, 8)  # the 50m preset
    assert cfg.seq_len == config.max_seq_len == CONTEXT["byte"]
    assert cfg.compile is True and cfg.trainer.precision == "bf16-mixed"
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.data.batch_size == 8
    assert cfg.trainer.max_time == "00:00:15:00" and cfg.decode.prompts == 40
    source = instantiate(cfg.data.source)
    assert isinstance(source, InstalledSource) and source.decontaminate == ("humaneval", "mbpp")
    assert (cfg.trainer.get("strategy") is not None) == (trainer == "fsdp")


def test_gpu_recipe_choices_yield_to_the_command_line() -> None:
    cfg = compose(["+experiment=bpe4", "trainer=gpu", "model=150m", "data=stdlib",
                   "data.batch_size=4", "run_dir=/tmp/unused"])
    OmegaConf.resolve(cfg)
    assert (cfg.model.dim, cfg.model.n_future, cfg.tokenizer.kind) == (768, 4, "bpe")
    assert cfg.optim.lr == pytest.approx(1e-3 * 512 / 768)  # the lr follows the width
    assert cfg.seq_len == cfg.model.max_seq_len == CONTEXT["bpe"]
    assert cfg.data.batch_size == 4 and isinstance(instantiate(cfg.data.source), StdlibSource)
    assert compose(["trainer=gpu", "data.source.cache_dir=/c", "run_dir=/tmp/unused"]
                   ).data.source.cache_dir == "/c"


def test_byte_presets_fit_every_benchmark_prompt_and_512_new_bytes() -> None:
    """The byte context (CONTEXT) holds each HumanEval and zero-shot MBPP prompt, the token
    that starts a document and eval's 512 new tokens (MBPP read from the shared data)."""
    from mtp.data.benchmarks import humaneval, mbpp

    tasks = [humaneval()]
    if (mbpp_file := mbpp_data_file()) is not None:
        tasks.append(mbpp(str(mbpp_file)))
    longest = max(len(p.prompt.encode()) for task in tasks for p in task.problems.values())
    assert longest + 1 + 512 <= CONTEXT["byte"]
    if len(tasks) == 2:  # sized for MBPP's longest prompt, not much more (without its file,
        assert CONTEXT["byte"] < longest + 1 + 512 + 1024  # HumanEval's alone fit easily)
    for model in ("50m", "150m", "400m"):
        cfg = compose(["+experiment=byte8", f"model={model}", "run_dir=/tmp/unused"])
        assert model_config(cfg, ByteTokenizer()).max_seq_len == CONTEXT["byte"]


@pytest.mark.parametrize("model", ["tiny", "small", "50m"])
def test_the_small_presets_train_a_step_on_cpu(model: str) -> None:
    cfg = compose(["+experiment=byte8", f"model={model}", "run_dir=/tmp/unused"])
    config = model_config(cfg, ByteTokenizer())
    model = MTPModel(config)
    optimizer = build_optimizer(model, OptimSettings(lr=1e-3))
    tokens = torch.randint(0, config.vocab_size, (1, 16 + config.n_future))
    out = mtp_loss(model, tokens, backward=autograd_backward)
    optimizer.step()
    assert torch.isfinite(out.loss) and len(out.head_losses) == 8
    assert all(p.grad is not None for p in model.parameters())


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


@pytest.mark.parametrize("head_type", ["block", "resblock", "linear", "sequential", "medusa"])
def test_added_heads_keep_byte1s_whole_model_for_every_head_type(head_type: str) -> None:
    """model.heads=added (the byte8_* recipes of docs/better.md): trunk + head 0 is byte1's
    model (11 + 1 blocks) and the 7 other heads come on top, of any type."""
    byte1 = model_config(compose(["+experiment=byte1", "run_dir=/tmp/unused"]), ByteTokenizer())
    cfg = compose(["+experiment=byte8_added", f"model.head_type={head_type}",
                   "run_dir=/tmp/unused"])
    check_settings(cfg)
    config = model_config(cfg, ByteTokenizer())
    assert (config.n_layers, config.n_future, config.head_type) == (11, 8, head_type)
    assert config.n_layers == byte1.n_layers and config.head_layers == byte1.head_layers
    with pytest.raises(ValueError, match="model.heads='on_top' is not one of"):
        try:
            model_config(compose(["model.heads=on_top", "run_dir=/tmp/unused"]), ByteTokenizer())
        except InstantiationException as error:  # Hydra wraps the config's own ValueError
            raise error.__cause__ from None


def test_the_recipes_weights_and_schedules() -> None:
    """DeepSeek-V3's lambda / D and its step, the curricula, modded-nanogpt's single head, and
    the finish that trains the heads alone."""
    def loss(experiment: str, *extra: str):
        return check_settings(compose([f"+experiment={experiment}", "run_dir=/tmp/unused",
                                       *extra])).loss

    light = loss("byte8_light")
    assert light.weights == pytest.approx((1.0,) + (0.3 / 7,) * 7)
    assert light.schedule == "constant"
    stepped = loss("byte8_stepped")
    assert (stepped.schedule, stepped.schedule_steps) == ("stepped", (270,))
    assert stepped.weights == light.weights
    assert stepped.schedule_factor * 0.3 == pytest.approx(0.1)
    assert (loss("byte8_anneal").schedule, loss("byte8_ramp").schedule) == ("anneal", "ramp")
    ahead = loss("byte1_ahead")
    assert (ahead.ahead, ahead.schedule, ahead.schedule_steps) == ((0.5, 0.25), "anneal",
                                                                   (0, 267))
    finish = check_settings(compose(["+experiment=heads_finish", "init_from=/unused/export",
                                     "run_dir=/tmp/unused"]))
    assert finish.optim.freeze_trunk and finish.optim.cache_trunk
    assert (finish.loss.schedule, finish.loss.ahead, finish.run.max_steps) == (
        "constant", None, 100)


def test_unknown_experiment_is_hydras_error() -> None:
    with pytest.raises(ConfigCompositionException, match="byte9"):
        compose(["+experiment=byte9"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["seq_len=2048"], r"seq_len=2048 must be .*model\.max_seq_len=1024"),
    (["+experiment=byte8", "loss.weights=[1,1]"],
     r"loss\.weights=\[1\.0, 1\.0\] .*model\.n_future=8"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1"),
    (["trainer.max_steps=null"], "trainer.max_steps=None must be a positive step budget"),
    (["optim.lr=-1"], r"^optim\.lr=-1\.0 must be > 0$"),
    (["optim.betas=[0.9,1.5]"], r"optim\.betas=\[0\.9, 1\.5\] must be two numbers in \[0, 1\)"),
    (["optim.accumulate=0"], "optim.accumulate=0 must be a positive integer"),
    (["optim.warmup_steps=2.5"], "optim.warmup_steps=2.5 must be an integer >= 0"),
    (["optim.min_lr_ratio=2"], r"optim\.min_lr_ratio=2\.0 must be in \[0, 1\]"),
    (["optim.cache_trunk=true"], "optim.cache_trunk=true keeps a frozen trunk's outputs"),
    (["loss.mode=fast"], "loss.mode='fast' is not one of"),
    (["loss.early_exit=0"], "loss.early_exit=0 must be a trunk layer"),
    (["+loss.typo=1"], "loss.typo is not a setting; loss has ahead, chunk_size, early_exit, "),
    (["loss.schedule=cosine"], "loss.schedule='cosine' is not one of"),
    (["+experiment=byte8", "loss.weights=[1,1,1,1,1,1,1,2]"],
     r"loss\.weights=\[1, .*, 2\] must be a list of numbers in \[0, 1\]"),
    (["+experiment=byte8_stepped", "trainer.max_steps=100"],
     r"loss\.schedule_steps=\[270\] must be within the run's trainer\.max_steps=100"),
    (["+experiment=byte1_ahead", "loss.ahead=[0.5,-1]"],
     r"loss\.ahead=\[0\.5, -1\] must be a list of numbers in \[0, 1\]"),
    (["threads=0"], "threads=0 must be a positive integer"),
    (["compile=yes"], "compile='yes' must be true or false"),
    (["activation_checkpointing=some"], "activation_checkpointing='some' is not one of"),
    (["fsdp.reduce_dtype=int8"], "fsdp.reduce_dtype='int8' is not one of"),
    (["trainer.peak_flops=v100"], "trainer.peak_flops='v100' is not a number, 'cpu' or one of"),
])
def test_inconsistent_settings_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_settings(compose([*overrides, "run_dir=/tmp/unused"]))


def test_the_settings_are_typed_and_frozen() -> None:
    """`check_settings` turns the config into the objects `MTPLitModule` takes: the values
    the user typed (lists, ints where floats go) in their types, never changed after."""
    settings = check_settings(compose(["+experiment=medusa2", "init_from=x", "optim.lr=1",
                                       "threads=auto", "run_dir=/tmp/unused"]))
    assert settings.loss.weights == pytest.approx((1.0, 0.8, 0.64, 0.512))
    assert isinstance(settings.loss.weights, tuple) and settings.optim.betas == (0.9, 0.95)
    assert settings.optim.lr == 1.0 and isinstance(settings.optim.lr, float)
    assert (settings.optim.base_lr_mult, settings.optim.heads_only_steps) == (0.1, 50)
    assert (settings.run.seq_len, settings.run.max_steps, settings.run.threads) == (256, 400, None)
    assert settings.init.init_from == "x" and settings.init.new_heads == "copy"
    assert TrainSettings.from_dict(settings.to_dict()) == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.optim.lr = 2.0  # type: ignore[misc]


def test_explicit_vocab_size_must_match_the_tokenizer() -> None:
    cfg = compose(["model.vocab_size=32000", "run_dir=/tmp/unused"])
    with pytest.raises(ValueError, match="model.vocab_size=32000 .*tokenizer=byte's vocab_size=262"):
        model_config(cfg, ByteTokenizer())


def test_cli_prints_the_composed_job() -> None:
    out = subprocess.run([sys.executable, "-m", "mtp.train", "+experiment=byte8", "--cfg", "job"],
                         capture_output=True, text=True, check=True, cwd=CONF_DIR.parent)
    job = OmegaConf.create(out.stdout)
    assert job.model.n_future == 8 and job.tokenizer.kind == "byte"
