"""The training recipe's Hydra overrides on a benchmark's command line (scripts/bench_train.py,
scripts/bench_heads.py): an argument is the recipe's when its key names a config group (a
folder of conf/: `model=tiny`), is nested (`optim.lr=1e-3`) or adds or removes one
(`+experiment=byte8`, `~logger`); every other argument is the script's own key=value.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mtp.paths import CONF_DIR

KEY = re.compile(r"^[+~]{0,2}(?P<key>[^=]+)")
KEYS = """
The recipe (python -m mtp.train's overrides): every argument whose key is a config group
(model=tiny, trainer=gpu), nested (model.dim=128, optim.lr=1e-3) or added (+experiment=...)
"""


def groups() -> set[str]:
    """The config groups: the folders of conf/."""
    return {path.name for path in CONF_DIR.iterdir() if path.is_dir()}


def is_override(argument: str) -> bool:
    """Whether `argument` is the recipe's."""
    match = KEY.match(argument)
    return match is not None and (argument[0] in "+~" or "." in match["key"]
                                  or match["key"] in groups())


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """`argv` as the script's own arguments and the recipe's overrides, each in order."""
    recipe = [argument for argument in argv if is_override(argument)]
    return [argument for argument in argv if not is_override(argument)], recipe
