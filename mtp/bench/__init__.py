"""Every published figure from one runner: `python -m mtp.bench SUITE`.

A suite (`smoke`, `cpu`, `gpu`; `suites.py`) is a list of parts, each a benchmark command run
as a subprocess with its own timeout, whose last stdout line (or a file it writes) is one JSON
object. The runner (`runner.py`) writes every part's figures to `results.json` with the
command, commit, device, CPU flags, load average before and after, and repeats, then
regenerates the tables of docs/benchmarks.md (and the README's headline table) between
`<!-- mtp.bench:begin NAME -->` / `<!-- mtp.bench:end NAME -->` markers (`tables.py`,
`markers.py`). The helpers the benchmark scripts share live here too (`machine.py`,
`prompts.py`, `tiny.py`, `hf.py`; and the keys their command lines share: `decoding.py`,
DecodeSettings' keys; `shape.py`, a random model's shape; `recipe.py`, the training recipe's
overrides): scripts import them, never each other. Every command takes key=value (`mtp.cli`).
"""
