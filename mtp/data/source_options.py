"""The command-line options that choose a corpus source, shared by the data scripts
(scripts/prepare_data.py, scripts/distill_data.py); they mirror conf/data/*.yaml."""

from __future__ import annotations

import argparse

from mtp.data import HubSource, InstalledSource, LocalSource, StdlibSource
from mtp.data.decontaminate import BENCHMARKS, NGRAM
from mtp.data.sources import Source


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `make_source` reads."""
    parser.add_argument("--source", choices=("stdlib", "installed", "local", "hub"),
                        default="stdlib")
    parser.add_argument("--paths", nargs="+", help="local: files, folders or globs; installed: "
                        "folders (default: sys.path's)")
    parser.add_argument("--decontaminate", nargs="*", choices=BENCHMARKS, default=BENCHMARKS,
                        help="installed: benchmarks to drop files for (none: no filter)")
    parser.add_argument("--humaneval-file", help="installed: HumanEval instead of the package's")
    parser.add_argument("--mbpp-file", help="MBPP's full mbpp.jsonl (installed: instead of the "
                        "Hub's; distill_data's --prompts-from mbpp: its train split)")
    parser.add_argument("--ngram", type=int, default=NGRAM,
                        help="installed: words shared with a problem that drop a file")
    parser.add_argument("--name", help="hub: dataset name")
    parser.add_argument("--config", help="hub: dataset config")
    parser.add_argument("--split", default="train", help="hub: dataset split")
    parser.add_argument("--revision", help="hub: dataset revision")
    parser.add_argument("--text-field", default="text")


def make_source(args: argparse.Namespace) -> Source:
    """The source the options of `add_source_arguments` name."""
    if args.source == "stdlib":
        return StdlibSource()
    if args.source == "installed":
        return InstalledSource(paths=args.paths, decontaminate=args.decontaminate,
                               humaneval_file=args.humaneval_file, mbpp_file=args.mbpp_file,
                               ngram=args.ngram, cache_dir=getattr(args, "cache_dir", None))
    if args.source == "local":
        if not args.paths:
            raise SystemExit("--source local needs --paths")
        return LocalSource(paths=args.paths, text_field=args.text_field)
    if not args.name:
        raise SystemExit("--source hub needs --name")
    return HubSource(name=args.name, config=args.config, split=args.split,
                     text_field=args.text_field, revision=args.revision)
