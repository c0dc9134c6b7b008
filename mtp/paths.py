"""Where the project's files live, in one place."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra configs; a checkout (or editable install) is assumed
