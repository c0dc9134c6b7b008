"""Markdown tables of a results.json: one block per part (its provenance line and a
renderer's table), a run block and the headline, by block name (`blocks`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mtp.paths import write_json

Record = dict[str, Any]
MIB = 2**20


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], head: str = "") -> str:
    """A Markdown table, under the paragraph `head` if one is given."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return (head + "\n\n" if head else "") + "\n".join(lines)


def provenance(record: Record) -> str:
    """The line above a table: the command and the conditions it ran in."""
    return (f"`{record['command']}`: {record['seconds']:.0f} s, load "
            f"{record['load_before'][0]:.1f}-{record['load_after'][0]:.1f}, "
            f"{record['device_name']}, commit {record['commit']}, {record['started']}")


def x(value: float) -> str:
    return f"{value:.2f}x"


def _f(value: float | None, form: str = ".2f", suffix: str = "") -> str:
    return "" if value is None else f"{value:{form}}{suffix}"


def _joined(values: Sequence[float], form: str = ".3f") -> str:
    return " ".join(f"{value:{form}}" for value in values)


def decode(r: dict[str, Any]) -> str:
    compiled = "eager_tokens_per_second" in r["per_k"][0]
    plain = "plain_cost" in r["per_k"][0]  # a plain forward over the step's tokens
    headers = ["decoding", "nodes", "tokens/s", "speed-up", "tok/fwd", "fwd cost",
               *(["plain cost"] if plain else []), "identical"]
    headers += ["eager tokens/s", "compiled / eager"] if compiled else []
    rows = [[f"k={row['k']}" if "k" in row else row["tree"], row["nodes"],
             row["tokens_per_second"], x(row["speedup"]), f"{row['tokens_per_forward']:.2f}",
             x(row["forward_cost"]), *([x(row["plain_cost"])] if plain else []), row["identical"],
             *([row["eager_tokens_per_second"], x(row["compile_speedup"])] if compiled else [])]
            for row in r["per_k"] + r.get("per_tree", [])]
    head = (f"{r['prompts']} prompts x {r['max_new_tokens']} new tokens, batch "
            f"{r['batch_size']}, greedy, {r['dtype']}, "
            f"{'compiled step' if r['compiled'] else 'eager step'}, {r['threads']} threads; "
            f"{r['repeated']:.0%} of the output repeats an earlier 8-gram")
    return table(headers, rows, head)


def methods(r: dict[str, Any]) -> str:
    # transformers' rows count no forwards: their tokens per forward and forward cost are blank
    rows = [[name, m["tokens_per_second"], x(m["speedup"]), _f(m["tokens_per_forward"]),
             _f(m["forward_cost"]), _f(m["identical"], ""), f"{m['repeated']:.2f}"]
            for name, m in r["methods"].items()]
    auto = ", ".join(f"{kind.strip()} {seconds:.1f} s"
                     for kind, seconds in r["auto_calibration_seconds"].items())
    head = (f"{r['prompts']} prompts x {r['max_new_tokens']} new tokens, batch 1, "
            f"{r['threads']} threads" + (f"; auto's measuring: {auto}" if auto else ""))
    return table(["method", "tokens/s", "speed-up", "tok/fwd", "fwd cost", "identical",
                  "repeated"], rows, head)


def exact(r: dict[str, Any]) -> str:
    rows = [[name, row["width"], row["plain"], row["exact"], f"{row['cost']:.3f}",
             x(row["speedup"]), f"{row['tokens_per_forward']:.2f}", row["identical"],
             row["plain_identical"]] for name, row in r["rows"].items()]
    head = (f"{r['prompts']} prompts x {r['max_new_tokens']} new tokens, batch 1, greedy, "
            f"{r['threads']} threads; speed-ups against float32 width-1 autoregressive "
            f"decoding ({r['baseline']} tokens/s)")
    return table(["method", "width", "plain tokens/s", "exact tokens/s", "cost", "speed-up",
                  "tok/fwd", "identical", "plain identical"], rows, head)


def acceptance(r: dict[str, Any]) -> str:
    rows = [[name, f"{row['tokens_per_forward']:.3f}", row["tokens_per_second"],
             _joined(row["accepted_per_depth"], ".2f")] for name, row in r["rules"].items()]
    head = (f"the heads' {r['tree']}, T = {r['temperature']}, {r['prompts']} prompts x "
            f"{r['max_new_tokens']} new tokens, batch 1, {r['threads']} threads")
    return table(["rule", "tok/fwd", "tokens/s", "accepted per depth"], rows, head)


def eagle(r: dict[str, Any]) -> str:
    steps = " ".join(str(j) for j in range(r["unroll"]))
    rows = [["steps, seconds", f"{r['steps']}, {r['seconds']:.0f}"],
            ["training tokens in the draft vocabulary", f"{r['coverage']:.1%}"],
            [f"val loss, unrolled steps {steps}", _joined(r["val_loss"])],
            [f"val accuracy, unrolled steps {steps}", _joined(r["val_accuracy"])]]
    history = r["history"][::-1][::max(1, len(r["history"]) // 8)][::-1]  # ~8, the last kept
    rows += [[f"step {step}: train loss, accuracy per unrolled step",
              f"{loss:.3f}, {_joined(accuracy)}"] for step, loss, accuracy in history]
    return table(["", ""], rows)


def _skipped(r: dict[str, Any], part: str) -> list[str]:
    """One line naming a part's rows that were not measured, by reason ([] if none)."""
    reasons: dict[str, list[str]] = {}
    for name, reason in r["skipped"].items():
        if name.startswith(part + " "):
            reasons.setdefault(reason, []).append(name.removeprefix(part + " "))
    return ["; ".join(f"{', '.join(names)}: not measured ({reason})"
                      for reason, names in reasons.items())] if reasons else []


def kernels(r: dict[str, Any]) -> str:
    """scripts/bench_kernels.py: memory bandwidth, the bare matrices, the step, SmolLM2."""
    k = r["kernels"]
    isa = f"mtp.kernels {k['isa']}" if k["available"] and k["active"] else \
        f"no kernels ({k['reason'] or 'off'})"
    bw = r["bandwidth"]
    floor = (f"; memory read {bw['gb_per_s']:.1f} GB/s (best of {bw['passes']} torch.sum over "
             f"{bw['bytes'] / 1e9:.2f} GB), the floor: bytes / that rate") if bw else ""
    # a checkpoint by its file name: the block's command names where it was found
    shapes = Path(r["checkpoint"]).name if r.get("checkpoint") else f"{r['scale']} shapes"
    out = [f"{shapes}, {r['threads']} threads, load {r['load'][0]:.1f}, flags "
           f"{' '.join(r['cpu_flags'])}, {isa}{floor}"]
    if r["matrices"]:
        m = r["matrices"]
        ms = list(next(iter(m["rows"].values()))["ms"]) if m["rows"] else []
        rows = [[name, f"{row['mb']:.0f}", *(f"{row['ms'][n]:.2f}" for n in ms),
                 _f(row["m8_over_m1"], suffix="x"), _f(row["gb_per_s_m1"], ".1f"),
                 _f(row["floor_ms"]), _f(row["m1_over_floor"], suffix="x")]
                for name, row in m["rows"].items()]
        out += [table(["arithmetic", "MB", *(f"M={n}" for n in ms), "M=8 / M=1", "GB/s at M=1",
                       "floor ms", "M=1 / floor"], rows,
                      f"one pass over the model's {m['count']} matrices ({m['params'] / 1e6:.1f}M "
                      f"weights, distinct random tensors) for M rows, ms, median of "
                      f"{m['repeats']}"), *_skipped(r, "matrices")]
    if r["step"]:
        s = r["step"]
        widths = list(map(str, s["widths"]))
        # the bare matrices' columns where that part ran; step(8) / step(1) where both were timed
        bare = any(v is not None for row in s["rows"].values() for v in row["matrices_ms"].values())
        ratio = {"1", "8"} <= set(widths)
        rows = [[name, *(cell for w in widths for cell in (
            f"{row['ms'][w]:.2f}", *([_f(row["matrices_ms"][w]),
                                      _f(row["over_matrices"][w], suffix="x")] if bare else []))),
                 *([x(row["step8_over_step1"])] if ratio else [])]
                for name, row in s["rows"].items()]
        headers = [h for w in widths for h in (
            f"step({w}) ms", *([f"matrices M={w} ms", f"step({w}) / matrices"] if bare else []))]
        out += [table(["arithmetic", *headers, *(["step(8) / step(1)"] if ratio else [])], rows,
                      f"a decode step: {', '.join(widths)} new tokens after "
                      f"{s['context']} cached ones, batch 1, "
                      f"{'its weights' if s['checkpoint'] else 'random weights'}; median of "
                      f"{s['repeats']} cached forwards (with the unembedding and argmax)"
                      + (" against a pass over its bare matrices" if bare else "")),
                *_skipped(r, "step")]
    if r["smollm2"]:
        e = r["smollm2"]
        sets = ", ".join(f"{n} {name}" for name, n in e["prompt_sets"].items())
        rows = [[name, f"{row['tokens_per_second']:.1f}", _f(row["speedup"], suffix="x"),
                 f"{row['tokens_per_forward']:.2f}", f"{row['repeated']:.2f}",
                 f"{row['identical']:.0%}"] for name, row in e["rows"].items()]
        out += [table(["decoding", "tokens/s", "speed-up", "tok/fwd", "repeated", "identical"],
                      rows, f"SmolLM2-135M-Instruct end to end: {e['prompts']} prompts ({sets}) "
                      f"x {e['max_new_tokens']} new tokens, greedy, batch 1; speed-up against "
                      f"float32 torch autoregressive; identical: the share of prompts whose ids "
                      f"are the same dtype's kernels autoregressive ids"), *_skipped(r, "smollm2")]
    elif "smollm2" in r["skipped"]:
        out.append(f"SmolLM2-135M end to end: not measured ({r['skipped']['smollm2']})")
    return "\n\n".join(out)


def hf(r: dict[str, Any]) -> str:
    per = r["per_method_tokens_per_second"]
    rows = [[name, value, x(value / r["hf_tokens_per_second"])] for name, value in per.items()]
    head = (f"{r['prompts']} prompts x <= {r['max_new_tokens']} new tokens ({r['new_tokens']} "
            f"generated), batch 1, greedy, {r['dtype']}, mtp "
            f"{'compiled' if r['compiled'] else 'eager'}, {r['threads']} threads, transformers "
            f"{r['transformers']}; every method the same ids: {r['identical']}; mtp k = "
            f"{r['mtp_spec_k']}: {r['mtp_spec_tokens_per_forward']:.2f} tokens per forward")
    return table(["method", "tokens/s", "vs transformers"], rows, head)


ENGINES = {"mtp": "mtp", "vllm": "vLLM", "llama_cpp": "llama.cpp"}


def engine_of(name: str) -> str:
    """A bench_engines row's engine by its name: "mtp", "llama_cpp" or "vllm" (named by method
    alone, or "vllm mtp")."""
    return "mtp" if name.startswith("mtp") else \
        "llama_cpp" if name.startswith("llama.cpp") else "vllm"


def engines(r: dict[str, Any]) -> str:
    """scripts/bench_engines.py: mtp's rows, then vLLM's decoding mtp's exports."""
    rows, reference = [], r["methods"]["mtp"]["tokens_per_second"]
    for name, m in r["methods"].items():
        key = engine_of(name)  # with the engine's version where it ran: "vLLM 0.32.0"
        engine = f"{ENGINES[key]} {m.get(key) or ''}".strip() if key != "mtp" else "mtp"
        method = "autoregressive float32" if name == "mtp" else \
            name.removeprefix("mtp ").removeprefix("llama.cpp ").removeprefix("vllm ")
        if not m.get("loaded"):
            rows.append([engine, method, f"refused: {m.get('error')}", "", "", "", ""])
            continue
        gaps = [d["top2_gap"] for d in m.get("divergences", [])]
        # vLLM counts accepted tokens over its drafting steps only (steps without an n-gram
        # match draft nothing), so its figure is not tokens per forward
        per_step = _f(m["tokens_per_forward"]) if m.get("tokens_per_forward") else \
            f"{m['mean_acceptance_length']:.2f} per drafting step" \
            if m.get("mean_acceptance_length") else ""
        rows.append([engine, method, _f(m["tokens_per_second"], ".1f"),
                     x(m["tokens_per_second"] / reference), per_step,
                     f"{m.get('same_ids', 1.0):.0%}" + (f" (min gap {min(gaps):.3g})"
                                                         if gaps else ""),
                     f"{m['exact_ids']:.0%}" if "exact_ids" in m else ""])
    best = "".join(f"; fastest exact mtp row ({r['mtp_best']}) over {engine}'s fastest "
                   f"({r[key + '_best']}): {x(r['speedup_vs_' + key])}"
                   for key, engine in (("vllm", "vLLM"), ("llama_cpp", "llama.cpp"))
                   if key + "_best" in r)
    loops = r["methods"]["mtp"].get("template_loops")
    head = (f"{r['prompts']} prompts{' as chat' if r.get('chat') else ''} x <= "
            f"{r['max_new_tokens']} new tokens, greedy, batch 1 (each prompt alone), k = "
            f"{r['k']}; vLLM in {r['dtype']}, llama.cpp on the GGUF's own quantized weights"
            + ("" if loops is None else f"; replies looping on template tokens: {loops}")
            + best)
    return table(["engine", "method", "tokens/s", "vs mtp float32", "tokens per forward",
                  "ids as mtp float32", "ids as its own autoregressive"], rows, head)


def memory(r: dict[str, Any]) -> str:
    variants = [key.removesuffix("_step_bytes") for key in r if key.endswith("_step_bytes")]
    rows = [[v.replace("_ac_", "+ac="), 1 if v.startswith("ntp") else r["n_future"],
             f"{r[v + '_peak_bytes'] / MIB:,.0f} MiB", f"{r[v + '_step_bytes'] / MIB:,.0f} MiB",
             f"{r.get(v + '_over_ntp', float('nan')):.2f}", f"{r[v + '_seconds']:.2f} s",
             f"{r.get(v + '_time_over_ntp', float('nan')):.2f}"] for v in variants]
    head = (f"one training step, vocabulary {r['vocab_size']}, batch {r['batch']} x "
            f"{r['seq_len']}, {r['device']}")
    return table(["variant", "n", "peak", "step", "step / next-token", "time",
                  "time / next-token"], rows, head)


def train_step(r: dict[str, Any]) -> str:
    rows = [[name, f"{rate:,.0f}", f"{r['mfu_per_variant'][name]:.2%}"]
            for name, rate in r["results"].items()]
    step = "; ".join([
        f"vocabulary {r['vocab_size']}, n = {r['n_future']}, batch {r['batch']} x {r['seq_len']}",
        f"{r['device']} {r['precision']}{', compiled' if r['compile'] else ''}",
        f"{r['threads']} threads",
        f"peak {r['peak_flops'] / 1e9:,.1f} GFLOP/s ({r['peak_source']})"])
    head = (f"{step}; step time n = {r['n_future']} / n = 1: {r['time_ratio_same_trunk']:.3f} "
            f"(same trunk), {r['time_ratio_compute_matched']:.3f} (compute-matched)")
    return table(["variant", "tokens/s", "MFU"], rows, head)


def peak_flops(r: dict[str, Any]) -> str:
    rows = [[dtype, f"{value / 1e9:,.1f}"] for dtype, value in r["peak_flops"].items()]
    return table(["dtype", "GFLOP/s (best matrix product)"], rows,
                 f"{r['device']}, {r['threads']} threads")


def fsdp_comms(r: dict[str, Any]) -> str:
    names = [key.removesuffix("_all_gathers") for key in r if key.endswith("_all_gathers")]
    rows = [[name.replace("_", " "), r[f"{name}_all_gathers"],
             f"{r[f'{name}_all_gather_bytes'] / MIB:.1f}", r[f"{name}_reduce_scatters"],
             f"{r[f'{name}_reduce_scatter_bytes'] / MIB:.1f}"] for name in names]
    head = (f"{r['world_size']} ranks, n = {r['n_future']}, {r['mode']}, accumulate "
            f"{r['accumulate']}, {r['fsdp_units']} FSDP units")
    return table(["", "all-gathers", "MiB", "reduce-scatters", "MiB"], rows, head)


def heads_cost(r: dict[str, Any]) -> str:
    rows = [[name.replace("block", "parallel"), f"{run['step_bytes'] / MIB:,.0f}",
             _f(run.get("step_seconds"))] for name, run in r["runs"].items()]
    return table(["heads", "step memory MiB", "step s"], rows,
                 f"byte8 shape, batch {r['batch']} x {r['seq_len']}, float32")


def sandbox(r: dict[str, Any]) -> str:
    rows = [[row["task"], row["programs"], row["isolation"], row["seconds"],
             row["ms_per_program"]] for row in r["results"]]
    return table(["task", "programs", "isolation", "seconds", "ms / program"], rows,
                 f"{r['workers']} workers")


def byte8(r: dict[str, Any]) -> str:
    val, dec = r["val"] or {}, r["decode"]
    rows = [["steps", f"{r['steps']} (stopped: {r['stopped_early'] or 'max_steps'})"],
            ["parameters", f"{r['parameters'] / 1e6:.1f}M"],
            ["val loss, summed over the heads", f"{val.get('loss', float('nan')):.3f}"],
            ["val accuracy, head 0 ... n-1", _joined(val.get("acc_head", []))]]
    if dec:
        rows += [["tokens per forward, k = 1 ... n",
                  _joined(dec["tokens_per_forward"].values(), ".2f")],
                 ["speed-up, k = 1 ... n", _joined(dec["speedup"].values(), ".2f")],
                 [f"tree {dec['tree']}: tokens per forward, speed-up",
                  f"{dec['tree_tokens_per_forward']}, {dec['tree_speedup']}"],
                 ["autoregressive tokens/s", dec["tokens_per_second_ar"]],
                 ["output repeating an earlier 8-gram", f"{dec['repeated']:.0%}"]]
        rows = [row for row in rows if "None" not in str(row[1])]
    return table(["", ""], rows)


def evaluation(r: dict[str, Any]) -> str:
    return table(["", ""], [[key, value] for key, value in r.items()
                            if not isinstance(value, (dict, list))])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        return " ".join(map(_cell, value))
    return "" if value is None else str(value)


def rows(r: dict[str, Any]) -> str:
    """A script's `rows` as they are (a list of records, or records by name), its other
    plain figures above them: for studies whose JSON already names every column."""
    records = r["rows"]
    named = isinstance(records, dict)
    records = [{"": name, **row} for name, row in records.items()] if named else records
    headers = list(dict.fromkeys(key for row in records for key in row))
    # a path of the measuring machine is left out: the block's command names the inputs
    head = ", ".join(f"{key} {_cell(value)}" for key, value in r.items()
                     if key != "rows" and not isinstance(value, (dict, list))
                     and not str(value).startswith("/"))
    return table(headers, [[_cell(row.get(key)) for key in headers] for row in records], head)


def online(r: dict[str, Any]) -> str:
    """scripts/bench_online.py: the heads frozen and learning online over one stream."""
    rows = [[arm, f"{a['tokens_per_forward']:.3f}", f"{a['first_window']:.3f}",
             f"{a['last_window']:.3f}", a["tokens_per_second"], a["tokens_per_second_decoding"],
             f"{a['learning_seconds']:.0f} s ({a['optimizer_steps']} steps)"
             if a["optimizer_steps"] else ""]
            for arm, a in (("frozen", r["frozen"]), ("online", r["online"]))]
    head = (f"{r['prompts']} prompts from offset {r['offset']} x {r['max_new_tokens']} new "
            f"tokens, greedy, k = {r['k']}, lr {r['lr']}, {r['steps']} step(s) a prompt; ids "
            f"{'identical' if r['identical'] else 'DIFFERING'} in both arms; {r['repeated']:.0%} "
            f"of the output repeats an earlier 16-gram")
    return table(["heads", "tok/fwd", f"first {r['window']} prompts",
                  f"last {r['window']} prompts", "tokens/s", "tokens/s without learning",
                  "learning"], rows, head)


def _spread(figure: dict[str, Any] | None, digits: int = 3) -> str:
    """A figure over seeds: its mean, +- its standard deviation where there are several."""
    if figure is None:
        return "-"
    return f"{figure['mean']:.{digits}f}" + (f" +- {figure['std']:.{digits}f}"
                                              if len(figure["seeds"]) > 1 else "")


def _steps(steps: list[int]) -> str:
    return f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}"


def paper_small(r: dict[str, Any]) -> str:
    """scripts/paper_small.py: each task, size and head count over seeds; induction's gaps."""
    rows = []
    for task in ("induction", "polynomial"):
        for size, cells in r["summary"].get(task, {}).items():
            for heads, cell in cells.items():
                detail = (_spread(cell["accuracy_first"]) if "accuracy_first" in cell else
                          _joined([m["mean"] for m in cell["accuracy_m"].values()], ".2f"))
                rows.append([task, size, heads, f"{cell['parameters']:,}", _steps(cell["steps"]),
                             _spread(cell["val_loss_head0"]),
                             _spread(cell.get("accuracy_repeated") or cell["accuracy"]),
                             detail])
    out = [table(["task", "size", "heads", "parameters", "steps", "val loss (head 0)",
                  "accuracy: repeated names (induction), exact match (polynomial)",
                  "induction: first occurrences (control); polynomial: exact match m = 1..10"],
                 rows, f"budget {r['budget']}, {r['device']}, {len(r['ladder']['seeds'])} "
                 f"seed(s), {r['seconds'] / 60:.0f} minutes")]
    gaps = dict(r["summary"].get("induction_gap_smallest", {}))
    if gaps:
        size = gaps.pop("size")
        out.append(table(
            [f"induction gap at {size}", "per seed", "mean", "90% interval"],
            [[name, _joined(g["seeds"], "+.3f"), f"{g['mean']:+.3f}",
              "-" if "interval90" not in g else
              f"[{g['interval90'][0]:+.3f}, {g['interval90'][1]:+.3f}]"]
             for name, g in gaps.items()]))
    return "\n\n".join(out)


def better_study(r: dict[str, Any]) -> str:
    """scripts/better_study.py: every recipe under each regime, over seeds, and its targets."""
    yes = {True: "yes", False: "no", None: "-"}
    rows = [[regime, name, _steps(cell["steps"]), _spread(cell["val_acc_head0"]),
             _spread(cell["val_loss_head0"]), _spread(cell["tokens_per_forward_k2"], 2),
             _spread(cell["tokens_per_forward_k4"], 2), _spread(cell["tokens_per_forward_k8"], 2),
             _spread(cell["tree_tokens_per_forward"], 2), _spread(cell["repeated"], 2),
             "-" if cell["step_ratio"] is None else x(cell["step_ratio"]),
             " ".join(yes[cell["targets"][key]] for key in ("accuracy", "drafting", "step"))]
            for regime, recipes in r["summary"].items() for name, cell in recipes.items()]
    return table(["regime", "recipe", "steps", "next-byte acc", "val loss (head 0)",
                  "tok/fwd k=2", "k=4", "k=8", "tree", "repeated", "step vs byte1",
                  "targets: acc, drafting, step"], rows,
                 f"size {r['size']}, {r['seconds'] / 60:.0f} minutes, commit {r['commit']}")


def tests(r: dict[str, Any]) -> str:
    return f"`{r['last_line']}` (exit {r['returncode']})"


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "decode": decode, "methods": methods, "exact": exact, "kernels": kernels,
    "engines": engines, "acceptance": acceptance, "eagle": eagle, "hf": hf, "memory": memory,
    "train_step": train_step, "peak_flops": peak_flops, "fsdp_comms": fsdp_comms,
    "heads_cost": heads_cost, "sandbox": sandbox, "byte8": byte8, "eval": evaluation,
    "tests": tests, "rows": rows, "paper_small": paper_small, "better_study": better_study,
    "online": online}


def part_block(record: Record, renderer: str) -> str:
    """A part's block: its provenance line and table."""
    if "skipped" in record:
        return f"Not measured: `{record['command']}` was skipped ({record['skipped']})."
    if record["result"] is None:
        return (provenance(record) + f"\n\nFailed (exit {record['returncode']}) after "
                f"{record['seconds']:.0f} s; the log is in the run's logs/ folder.")
    return provenance(record) + "\n\n" + RENDERERS[renderer](record["result"])


def _commits(results: Record) -> str:
    """The commits the run's parts ran at (parts rerun with `only` may differ)."""
    commits = sorted({p["commit"] for p in results["parts"].values() if p.get("commit")})
    return ", ".join(map(str, commits or [results["commit"]]))


def _machine(results: Record) -> str:
    m = results["machine"]
    return (f"{m['device_name']} ({m['cpus']} cores, flags {' '.join(m['cpu_flags'])}; torch "
            f"{m['torch']})")


def run_block(results: Record) -> str:
    """Which run the tables come from: suite, commits, machine, time, load."""
    started = min([p["started"] for p in results["parts"].values() if "started" in p]
                  or [results["started"]])
    wall = f" ({results['seconds'] / 60:.0f} minutes)" if "seconds" in results else ""
    return (f"Generated by `python -m mtp.bench {results['suite']}` at commit "
            f"{_commits(results)}, {started} to {results.get('finished', '?')}{wall}, on "
            f"{_machine(results)}; load average {results['load_before'][0]:.1f} before, "
            f"{results.get('load_after', ['?'])[0]} after (1-minute); each table's first line "
            f"has its own command, commit, time and load.")


def _headline_rows(parts: dict[str, Any]) -> list[list[str]]:
    """One row per claim, from whichever parts succeeded: what, figure, its command."""
    rows = []
    if trained := parts.get("byte8"):
        accs = (trained.get("val") or {}).get("acc_head", [])
        if accs:
            rows.append([f"`+experiment=byte8`: {trained['parameters'] / 1e6:.1f}M parameters, "
                         f"{len(accs)} heads, {trained['steps']} steps",
                         f"next-byte accuracy **{accs[0]:.3f}**, last head {accs[-1]:.3f}",
                         "`python -m mtp.train`"])
    if d := parts.get("decode"):
        rows.append([f"greedy decoding with the heads, {d['prompts']} prompts, "
                     f"batch 1", f"**{x(d['speedup'])}** at k = {d['k']} "
                     f"({d['tokens_per_forward']:.2f} tokens per forward), ids "
                     f"{'identical' if d['identical'] else 'DIFFERING'}; {d['repeated']:.0%} "
                     f"repeats an earlier 8-gram", "`scripts/bench_decode.py`"])
    if m := parts.get("methods"):
        name, best = max(m["methods"].items(), key=lambda item: item[1]["speedup"])
        rows.append([f"every drafter, {m['prompts']} prompts, the fastest",
                     f"{name}: **{x(best['speedup'])}** ({best['tokens_per_forward']:.2f} "
                     f"tokens per forward)", "`scripts/bench_methods.py`"])
    if k := parts.get("kernels"):
        matrices = (k.get("matrices") or {}).get("rows", {})
        ours, torch = matrices.get("kernels bfloat16"), matrices.get("torch float32")
        if ours and torch and ours["m8_over_m1"] and torch["m8_over_m1"]:
            rows.append([f"one pass over the {k['matrices']['count']} matrices of a "
                         f"{k['matrices']['params'] / 1e6:.0f}M model, 8 rows against 1",
                         f"mtp's kernels bfloat16 **{ours['m8_over_m1']:.2f}x** (torch float32 "
                         f"{torch['m8_over_m1']:.2f}x)", "`scripts/bench_kernels.py`"])
        if smollm2 := k.get("smollm2"):
            name, best = max(smollm2["rows"].items(), key=lambda item: item[1]["speedup"] or 0)
            rows.append([f"SmolLM2-135M, {smollm2['prompts']} prompts, greedy, on the kernels",
                         f"{name}: **{x(best['speedup'])}** float32 torch autoregressive "
                         f"({smollm2['baseline']:.1f} tokens/s); ids its dtype's autoregressive "
                         f"ids on {best['identical']:.0%} of prompts",
                         "`scripts/bench_kernels.py`"])
    if m := parts.get("memory"):
        rows.append([f"training step peak memory over next-token (n = {m['n_future']}, vocab "
                     f"{m['vocab_size']})", f"head by head **{m['headwise_over_ntp']:.2f}x**"
                     + (f", all heads at once {m['naive_over_ntp']:.2f}x"
                        if "naive_over_ntp" in m else ""), "`scripts/bench_memory.py`"])
    if t := parts.get("train_step"):
        rows.append([f"training step time n = {t['n_future']} over n = 1, compute-matched",
                     f"{t['time_ratio_compute_matched']:.2f}x, MFU {t['mfu']:.1%} "
                     f"({t['precision']})", "`scripts/bench_train.py`"])
    if h := parts.get("hf"):
        static = h.get("mtp_ar_over_hf_static")
        rows.append(["autoregressive decoding against transformers' `generate`",
                     f"eager {x(h['mtp_ar_over_hf'])}" + (
                         f", {x(static)} its compiled static cache" if static else "")
                     + f"; speculative {x(h['mtp_spec_over_hf'])}", "`scripts/bench_hf.py`"])
    return rows


def headline(results: Record) -> str:
    """The README's small table, every figure from this run, and where it ran."""
    parts = {name: record.get("result") for name, record in results["parts"].items()}
    rows = _headline_rows(parts)
    if not rows:
        return "No headline figures: the run measured none."
    loads = [load[0] for record in results["parts"].values()
             for load in (record.get("load_before"), record.get("load_after")) if load]
    run = (f"one `python -m mtp.bench {results['suite']}` run of "
           f"{results['seconds'] / 60:.0f} minutes" if "seconds" in results else
           f"`python -m mtp.bench {results['suite']}`")
    return table(["what", "figure", "command"], rows) + (
        f"\n\nAll from {run} at commit {_commits(results)} on {_machine(results)}, load "
        f"average {min(loads):.1f}-{max(loads):.1f} (timed figures move with it); each figure's "
        f"command, table and caveats: [docs/benchmarks.md](docs/benchmarks.md).")


def blocks(results: Record, renderers: dict[str, str]) -> dict[str, str]:
    """Block name -> Markdown for every part in `results` (`renderers`: part name -> its
    renderer's name), plus `run_SUITE` (which run the tables come from) and `headline`."""
    out = {f"run_{results['suite']}": run_block(results), "headline": headline(results)}
    for name, record in results["parts"].items():
        renderer = renderers.get(name, name)
        if renderer != "none":  # a step with no table (a search)
            out[name] = part_block(record, renderer)
    return out


def publish(report: Record, render: Callable[[Record], str], path: Path) -> Record:
    """A study script's ending: `report` written to `path`, printed as `render`'s table, then
    as the last-line JSON the runner reads; the report as the file holds it."""
    report = json.loads(json.dumps(report))  # what the file and the last line hold
    write_json(path, report)
    print(render(report))
    print(json.dumps(report), flush=True)
    return report

