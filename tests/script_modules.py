"""scripts/NAME.py as a module, for tests that call its functions (`parse_args`, `main`).

Registered in sys.modules under its own name before it runs, as an import would: its
dataclass schemas (and the type hints `mtp.cli` reads from them) find their module there.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(path: str | Path) -> ModuleType:
    """scripts/`path`.py (a name) or the script at `path` (a file), loaded once."""
    path = Path(path)
    if path.suffix != ".py":
        path = SCRIPTS / f"{path}.py"
    name = f"mtp_script_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def prompt_file(tmp_path: Path) -> Path:
    """The benchmark scripts' test prompts: one code line and one that repeats itself."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps("def f(x):") + "\n" + json.dumps("ab ab ab ab ab") + "\n")
    return path


def tiny_export(tmp_path: Path) -> Path:
    """A random 4-head byte model exported to `tmp_path/export`."""
    from mtp.checkpoint import export
    from mtp.model import MTPConfig, MTPModel
    from mtp.tokenizers import ByteTokenizer

    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_future=4, max_seq_len=64)
    return export(MTPModel(config), ByteTokenizer(), tmp_path / "export")
