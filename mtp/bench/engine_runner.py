"""Decode token-id prompts with another engine, offline, and write what happened as JSON: the
runner that scripts/bench_engines.py starts, by path, with that engine's own python (so it
imports only the engine and the standard library).

    ENGINE_PYTHON mtp/bench/engine_runner.py JOB.json RESULT.json

JOB.json: `engine` ("vllm" or "llama_cpp"), `model` (vLLM: a directory; llama.cpp: a GGUF
file), `max_new_tokens`, `prompts` (lists of token ids: every engine decodes the same ids),
`stop_token_ids` (where mtp stops); vLLM's `dtype`, `speculative_config` (null:
autoregressive) and optional `max_model_len`, `kv_cache_bytes`; llama.cpp's `threads`, `n_ctx`
and `prompt_lookup` (null: autoregressive; else the tokens llama-cpp-python's
`LlamaPromptLookupDecoding` drafts per step).
RESULT.json: `loaded`, `error` (the engine's error in one line, or null), `token_ids` (per
prompt, greedy, ending with the stop token where one came, as mtp's), `seconds` and
`tokens_per_second` (each prompt alone, batch 1, after an untimed warm-up prompt), the engine's
version (`vllm`, `llama_cpp`), and vLLM's `batched_tokens_per_second` (all prompts in one call)
and `mean_acceptance_length` (1 + accepted / drafts; null without drafts) or llama.cpp's
`tokens_per_forward` (new tokens per evaluation, the prompt's included).
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def time_prompts(decode, prompts: list[list[int]]) -> tuple[dict, int]:
    """Each prompt decoded alone by `decode(prompt) -> (new ids, evaluations)` (the caller has
    warmed it up): the ids, seconds, new tokens and tokens per second; the evaluations."""
    token_ids, seconds, evaluations = [], 0.0, 0
    for prompt in prompts:
        began = time.perf_counter()
        out, calls = decode(prompt)
        seconds += time.perf_counter() - began
        token_ids.append(out)
        evaluations += calls
    new_tokens = sum(map(len, token_ids))
    return {"token_ids": token_ids, "seconds": round(seconds, 3), "new_tokens": new_tokens,
            "tokens_per_second": round(new_tokens / seconds, 2)}, evaluations


def counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens), summed over
    labels."""
    totals: dict[str, int] = {}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name.startswith("vllm:spec_decode_num") and hasattr(metric, "value"):
            totals[name] = totals.get(name, 0) + int(metric.value)
    return totals


def run_vllm(job: dict) -> dict:
    """vLLM: load the model as `job` says and decode its prompts greedily."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, seed=0,
              speculative_config=job.get("speculative_config"), disable_log_stats=False,
              max_model_len=job.get("max_model_len", 2048), max_num_seqs=8,
              # vLLM's CPU backend otherwise reserves 92% of the machine's memory
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 1 << 30))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], detokenize=False,
                            stop_token_ids=job.get("stop_token_ids"))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]

    def decode(prompt) -> tuple[list[int], int]:
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids), 0  # vLLM's steps: its spec-decode counters

    decode(prompts[0])  # warm-up
    before = counters(llm)
    timed, _ = time_prompts(decode, prompts)
    after = counters(llm)
    began = time.perf_counter()
    batched = llm.generate(prompts, params, use_tqdm=False)
    batched_seconds = time.perf_counter() - began
    drafts, accepted = (after.get(key, 0) - before.get(key, 0) for key in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"))
    new_tokens = sum(len(o.outputs[0].token_ids) for o in batched)
    return {"vllm": vllm.__version__, **timed,
            "batched_tokens_per_second": round(new_tokens / batched_seconds, 2),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "drafts": drafts, "accepted_tokens": accepted}


def llama_cpp_decode(llm, prompt: list[int], max_new_tokens: int,
                     stops: set[int]) -> tuple[list[int], int]:
    """One prompt's greedy continuation and how many evaluations it took."""
    calls = 0
    evaluate = llm.eval

    def counted(tokens):  # llama-cpp-python evaluates the prompt, then one step per call
        nonlocal calls
        calls += 1
        return evaluate(tokens)

    llm.eval = counted
    out: list[int] = []
    try:
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in stops or len(out) == max_new_tokens:
                break
    finally:
        llm.eval = evaluate
    return out, calls  # the prompt's evaluation gives the first token, as mtp counts it


def run_llama_cpp(job: dict) -> dict:
    """llama.cpp: load the GGUF and decode its prompts greedily."""
    import llama_cpp
    from llama_cpp import Llama

    draft = None
    if job.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=job["prompt_lookup"])
    llm = Llama(model_path=job["model"], n_ctx=job.get("n_ctx", 4096),
                n_threads=job.get("threads"), seed=0, verbose=False, draft_model=draft)
    decode = functools.partial(llama_cpp_decode, llm, max_new_tokens=job["max_new_tokens"],
                               stops=set(job.get("stop_token_ids") or ()))
    decode(job["prompts"][0])  # warm-up
    timed, evaluations = time_prompts(decode, job["prompts"])
    return {"llama_cpp": llama_cpp.__version__, **timed,
            "tokens_per_forward": round(timed["new_tokens"] / max(evaluations, 1), 3)}


RUNS = {"vllm": run_vllm, "llama_cpp": run_llama_cpp}


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as file:
        job = json.load(file)
    try:
        result = {"loaded": True, "error": None, **RUNS[job["engine"]](job)}
    except Exception as error:  # an engine refusing an export is a result, not a crash
        traceback.print_exc()
        result = {"loaded": False, "error": one_line(error)}
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is needed
    main(sys.argv[1:])
