"""Every published figure from one runner: `python -m mtp.bench SUITE`.

A suite (`suites.py`) lists parts, each a benchmark command run as a subprocess with its own
timeout; `runner.py` writes their JSON figures to `results.json` with the conditions they ran
in, then the docs' tables are regenerated (`tables.py`, `markers.py`). The helpers the
benchmark scripts share live here too.
"""
