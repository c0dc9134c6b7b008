"""Decode token-id prompts with vLLM offline and write what happened as JSON: the runner that
scripts/bench_engines.py starts, by path, with the engine's own python.

    ENGINE_PYTHON mtp/bench/vllm_runner.py JOB.json RESULT.json

It imports only vLLM and the standard library (it runs in vLLM's environment, not mtp's).
JOB.json holds `model` (a directory), `dtype`, `max_new_tokens`, `prompts` (lists of token
ids: both engines decode the same input ids), `stop_token_ids` (where mtp stops) and
`speculative_config` (vLLM's mapping, or null for autoregressive decoding); optionally
`max_model_len` (2048) and `kv_cache_bytes` (1 GiB). RESULT.json gets `loaded`, `error`
(vLLM's error in one line, or null), `token_ids` (per prompt, greedy), `seconds` and
`tokens_per_second` (each prompt decoded alone, batch 1, after one untimed warm-up
prompt), `batched_tokens_per_second` (all prompts in one call), `mean_acceptance_length`
(1 + accepted / drafts, from vLLM's spec-decode counters; null without drafts) and `vllm`
(its version).
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens), summed over
    labels."""
    totals: dict[str, int] = {}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name.startswith("vllm:spec_decode_num") and hasattr(metric, "value"):
            totals[name] = totals.get(name, 0) + int(metric.value)
    return totals


def run(job: dict) -> dict:
    """Load the model as `job` says and decode its prompts greedily (see the docstring)."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict = {"loaded": False, "error": None, "vllm": vllm.__version__}
    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, seed=0,
              speculative_config=job.get("speculative_config"), disable_log_stats=False,
              max_model_len=job.get("max_model_len", 2048), max_num_seqs=8,
              # vLLM's CPU backend otherwise reserves 92% of the machine's memory
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 1 << 30))
    result["loaded"] = True
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], detokenize=False,
                            stop_token_ids=job.get("stop_token_ids"))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    before = counters(llm)
    token_ids, seconds = [], 0.0
    for prompt in prompts:
        began = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - began
        token_ids.append(list(output.outputs[0].token_ids))
    after = counters(llm)
    began = time.perf_counter()
    batched = llm.generate(prompts, params, use_tqdm=False)
    batched_seconds = time.perf_counter() - began
    new_tokens = sum(map(len, token_ids))
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0)
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    result.update(
        token_ids=token_ids, seconds=round(seconds, 3), new_tokens=new_tokens,
        tokens_per_second=round(new_tokens / seconds, 2),
        batched_tokens_per_second=round(
            sum(len(o.outputs[0].token_ids) for o in batched) / batched_seconds, 2),
        mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None,
        drafts=drafts, accepted_tokens=accepted)
    return result


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as file:
        job = json.load(file)
    try:
        result = run(job)
    except Exception as error:  # vLLM refusing an export is a result, not a crash
        traceback.print_exc()
        result = {"loaded": False, "error": one_line(error)}
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is needed
    main(sys.argv[1:])
