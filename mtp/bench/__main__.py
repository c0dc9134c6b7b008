"""`python -m mtp.bench SUITE`: run a suite, write results.json, regenerate the docs' tables.

    python -m mtp.bench smoke --out /tmp/smoke           # seconds: every runner path, tiny
    flock /work/cpu.lock python -m mtp.bench cpu         # docs/benchmarks.md's CPU tables
    python -m mtp.bench gpu --budget 540                 # one CUDA device, a 15-minute lease
    python -m mtp.bench cpu --only decode hf             # rerun parts, keep the others
    python -m mtp.bench cpu --from-results runs/bench/cpu/results.json   # only re-render

The cpu and gpu suites rewrite the generated blocks of docs/benchmarks.md and README.md
(`--docs`, `--readme`; `--no-docs` leaves them); smoke writes only where told.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtp.bench.markers import block_names, replace_blocks
from mtp.bench.runner import run_suite
from mtp.bench.suites import SUITES, suite
from mtp.bench.tables import blocks

REPO = Path(__file__).resolve().parents[2]


def update(path: Path, generated: dict[str, str]) -> list[str]:
    """Rewrite the generated blocks of the Markdown file `path`; the names rewritten."""
    text = path.read_text()
    new = replace_blocks(text, generated)
    if new != text:
        path.write_text(new)
    return [name for name in block_names(text) if name in generated]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m mtp.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=list(SUITES))
    parser.add_argument("--out", type=Path, help="default: runs/bench/SUITE")
    parser.add_argument("--only", nargs="+", default=[], metavar="PART")
    parser.add_argument("--from-results", type=Path, help="render this results.json, run nothing")
    parser.add_argument("--docs", type=Path, help="default: docs/benchmarks.md (cpu, gpu)")
    parser.add_argument("--readme", type=Path, help="default: README.md (cpu)")
    parser.add_argument("--no-docs", action="store_true", help="write results.json only")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="stop starting parts after this long (a GPU lease); each part's "
                             "timeout is cut to what is left")
    args = parser.parse_args(argv)
    parts = suite(args.suite)
    if args.from_results:
        results = json.loads(args.from_results.read_text())
    else:
        out = args.out or REPO / "runs" / "bench" / args.suite
        results = run_suite(args.suite, parts, out.resolve(), REPO, args.only, args.budget)
    generated = blocks(results, {p.name: p.renderer for p in parts})
    targets = [args.docs, args.readme]
    if args.suite != "smoke":
        targets = [args.docs or REPO / "docs" / "benchmarks.md",
                   args.readme or (REPO / "README.md" if args.suite == "cpu" else None)]
    for path in [] if args.no_docs else [t for t in targets if t is not None]:
        print(f"[mtp.bench] {path}: regenerated {', '.join(update(path, generated)) or 'nothing'}")
    failed = [name for name, record in results["parts"].items() if record.get("result") is None]
    print(json.dumps({"suite": results["suite"], "commit": results["commit"],
                      "parts": len(results["parts"]), "failed": failed}))
    return results


if __name__ == "__main__":
    main()
