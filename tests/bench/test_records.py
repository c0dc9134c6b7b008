"""The records the docs publish can be rerun: every generated block's recorded command parses
under today's command line of what it runs, and no block names a path of the machine that
measured it (a reader reruns a figure from the checkout, with $GGUF-style variables)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_docs import parse_args_of  # tests/ is on the path

from mtp.bench.markers import BLOCK
from mtp.train.run import compose

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/benchmarks.md", "docs/better.md")
# A block's command: the first `python ...` in backquotes on its first line.
COMMAND = re.compile(r"`(python [^`]+)`")
# An absolute path: a slash-rooted run of path parts after a space, `=`, `(` or a quote.
ABSOLUTE = re.compile(r"(?:^|[\s=(`'\"\[,])(/(?:[\w.@+-]+/)+[\w.@+-]*)", re.MULTILINE)


def _blocks() -> list[tuple[str, str, str]]:
    """(page, block name, body) of every generated block."""
    found = []
    for page in PAGES:
        path = REPO / page
        if path.is_file():
            found += [(page, m.group("name"), m.group("body"))
                      for m in BLOCK.finditer(path.read_text())]
    return found


def _parses(command: str) -> str | None:
    """None where `command` parses today; else why not (one line)."""
    words = shlex.split(command.replace("$", ""))  # $GGUF: a value like any other
    if words[:2] == ["python", "-m"] and words[2] == "pytest":
        return None  # pytest's own command line
    try:
        if words[:3] == ["python", "-m", "mtp.train"]:
            compose([w for w in words[3:] if not w.startswith("hydra.")] + ["run_dir=x"])
        elif words[:2] == ["python", "-m"]:
            parse_args_of(words[2])(words[3:])
        elif words[1].startswith("scripts/"):
            parse_args_of(words[1])(words[2:])
        else:
            return f"not a command this test knows: {command!r:.80}"
    except (ValueError, SystemExit, Exception) as error:  # noqa: B014 (Hydra's own errors)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def test_recorded_commands_parse_today() -> None:
    stale: dict[str, str] = {}  # block -> why its command no longer parses
    for page, name, body in _blocks():
        first = body.strip().splitlines()[0] if body.strip() else ""
        command = COMMAND.search(first)
        if command and (why := _parses(command.group(1))) is not None:
            stale[f"{page}: {name}"] = why
    assert stale == {}


@pytest.mark.parametrize("command, ok", [
    ("python scripts/bench_engines.py checkpoint=$GGUF max_new_tokens=64", True),
    ("python scripts/bench_decode.py --checkpoint x --ks 2 4", False),
    ("python -m mtp.eval task=humaneval checkpoint=x limit=4", True),
    ("python -m mtp.train +experiment=byte8 logger=csv hydra.run.dir=runs/x", True),
    ("python -m mtp.train +experiment=nope", False),
    ("""python scripts/bench_exact.py checkpoint=x 'methods=[eagle,"eagle tree=dynamic:16"]'""",
     True),
])
def test_a_stale_command_is_told_apart(command: str, ok: bool) -> None:
    assert (_parses(command) is None) == ok


def test_no_block_names_a_path_of_the_measuring_machine() -> None:
    found = {(page, name): ABSOLUTE.findall(body) for page, name, body in _blocks()}
    assert {key: paths for key, paths in found.items() if paths} == {}
