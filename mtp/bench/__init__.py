"""Every published figure from one runner: `python -m mtp.bench SUITE`.

A suite (`suites.py`) is a list of parts, each a benchmark command run as a subprocess with
its own timeout, whose figures are one JSON object. The runner (`runner.py`) writes them to
`results.json` with the conditions they ran in, then regenerates the tables of
docs/benchmarks.md and README.md between `<!-- mtp.bench:begin NAME -->` markers
(`tables.py`, `markers.py`). The helpers the benchmark scripts share live here too.
"""
