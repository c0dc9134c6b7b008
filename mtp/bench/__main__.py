"""`python -m mtp.bench SUITE [key=value ...]`: run a suite, write results.json, regenerate the
docs' tables.

    python -m mtp.bench smoke out=/tmp/smoke            # seconds: every runner path, tiny
    flock "$LOCK" python -m mtp.bench cpu               # docs/benchmarks.md's CPU tables
    python -m mtp.bench gpu budget=540                  # one CUDA device, a 15-minute lease
    python -m mtp.bench cpu only=[decode,hf]            # rerun parts, keep the others
    python -m mtp.bench kernels                         # mtp.kernels against torch
    python -m mtp.bench studies                         # dtype, threads, layer skipping
    python -m mtp.bench better                          # docs/better.md's studies, hours
    MTP_VLLM_PYTHON=../vllm-venv/bin/python python -m mtp.bench engines   # beside vLLM
    python -m mtp.bench cpu from_results=runs/bench/cpu/results.json   # only re-render

The suite is the first word: smoke, cpu, gpu, smollm2, kernels, engines, studies or better
(`mtp.bench.suites`). All but smoke rewrite the generated blocks of docs/benchmarks.md
(better: docs/better.md; cpu: README.md's headline too; `docs`, `readme`; update_docs=false
leaves them); smoke writes only where told. The other arguments are key=value (`mtp.cli`'s
grammar):
  out            the results' folder (null: runs/bench/SUITE of the checkout)
  only           [] parts to run again, keeping the others' records of an earlier run
  from_results   render this results.json, run nothing
  docs           the page of generated tables (null: as above; smoke: none)
  readme         the front page's headline (null: README.md for cpu)
  update_docs    true; false writes results.json only
  budget         seconds: stop starting parts after this long (a GPU lease); each part's
                 timeout is cut to what is left (null: no limit)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp import cli
from mtp.bench.markers import block_names, replace_blocks
from mtp.bench.runner import run_suite
from mtp.bench.suites import SUITES, suite
from mtp.bench.tables import blocks

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class BenchArgs:
    out: Path | None = None
    only: list[str] = field(default_factory=list)
    from_results: Path | None = None
    docs: Path | None = None
    readme: Path | None = None
    update_docs: bool = True
    budget: float | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not self.budget > 0:
            raise ValueError(f"budget={self.budget!r} must be > 0 seconds")


def parse_args(argv: list[str]) -> tuple[str, BenchArgs]:
    """The suite and its key=value arguments; ValueError naming anything unexpected."""
    if not argv or argv[0] not in SUITES:
        raise ValueError(f"the first argument must be a suite, one of {', '.join(SUITES)}; "
                         f"got {argv[:1]}")
    return argv[0], cli.parse(argv[1:], BenchArgs)


def update(path: Path, generated: dict[str, str]) -> list[str]:
    """Rewrite the generated blocks of the Markdown file `path`; the names rewritten."""
    text = path.read_text()
    new = replace_blocks(text, generated)
    if new != text:
        path.write_text(new)
    return [name for name in block_names(text) if name in generated]


def page(suite_name: str) -> Path:
    """The page a suite's blocks live in (the cpu suite's headline: README.md too)."""
    return REPO / "docs" / ("better.md" if suite_name == "better" else "benchmarks.md")


def main(argv: list[str]) -> dict:
    name, args = parse_args(argv)
    parts = suite(name)
    if args.from_results:
        results = json.loads(args.from_results.read_text())
    else:
        out = args.out or REPO / "runs" / "bench" / name
        results = run_suite(name, parts, out.resolve(), REPO, args.only, args.budget)
    generated = blocks(results, {p.name: p.renderer for p in parts})
    targets = [args.docs or (None if name == "smoke" else page(name)),
               args.readme or (REPO / "README.md" if name == "cpu" else None)]
    for path in filter(None, targets) if args.update_docs else []:
        print(f"[mtp.bench] {path}: regenerated {', '.join(update(path, generated)) or 'nothing'}")
    failed = [part for part, record in results["parts"].items() if record.get("result") is None]
    print(json.dumps({"suite": results["suite"], "commit": results["commit"],
                      "parts": len(results["parts"]), "failed": failed,
                      "seconds": results.get("seconds")}))
    return results


if __name__ == "__main__":
    cli.main(main, __doc__)
