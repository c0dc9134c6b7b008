"""scripts/NAME.py as a module, for tests that call its functions (`parse_args`, `main`).

Registered in sys.modules under its own name before it runs, as an import would: its
dataclass schemas (and the type hints `mtp.cli` reads from them) find their module there.
"""

from __future__ import annotations

import importlib.util
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
