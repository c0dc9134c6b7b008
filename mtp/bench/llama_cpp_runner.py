"""Decode token-id prompts with llama.cpp (llama-cpp-python) from a GGUF and write what
happened as JSON: the runner that scripts/bench_engines.py starts, by path, with the python of
an environment that has llama-cpp-python.

    ENGINE_PYTHON mtp/bench/llama_cpp_runner.py JOB.json RESULT.json

It imports only llama_cpp, numpy and the standard library. JOB.json holds `model` (the GGUF),
`prompts` (lists of token ids: mtp's, so both engines decode the same input), `max_new_tokens`,
`stop_token_ids`, `threads`, `n_ctx` and `prompt_lookup` (null: autoregressive; else the
tokens llama-cpp-python's `LlamaPromptLookupDecoding` drafts per step). RESULT.json gets
`loaded`, `error` (one line, or null), `token_ids` (per prompt, greedy, ending with the stop
token where one came, as mtp's), `seconds` and `tokens_per_second` (each prompt alone, after
one untimed warm-up prompt), `tokens_per_forward` (new tokens per llama.cpp evaluation) and
`llama_cpp` (its version).
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def decode(llm, prompt: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], int]:
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
    return out, calls - 1  # the prompt's evaluation is not a decode step


def run(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    result: dict = {"loaded": False, "error": None, "llama_cpp": llama_cpp.__version__}
    draft = None
    if job.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=job["prompt_lookup"])
    llm = Llama(model_path=job["model"], n_ctx=job.get("n_ctx", 4096),
                n_threads=job.get("threads"), seed=0, verbose=False, draft_model=draft)
    result["loaded"] = True
    stops, budget = set(job.get("stop_token_ids") or ()), job["max_new_tokens"]
    decode(llm, job["prompts"][0], budget, stops)  # warm-up
    token_ids, seconds, steps = [], 0.0, 0
    for prompt in job["prompts"]:
        began = time.perf_counter()
        out, calls = decode(llm, prompt, budget, stops)
        seconds += time.perf_counter() - began
        token_ids.append(out)
        steps += calls
    new_tokens = sum(map(len, token_ids))
    result.update(token_ids=token_ids, seconds=round(seconds, 3), new_tokens=new_tokens,
                  tokens_per_second=round(new_tokens / seconds, 2),
                  tokens_per_forward=round(new_tokens / max(steps, 1), 3))
    return result


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as file:
        job = json.load(file)
    try:
        result = run(job)
    except Exception as error:  # a refusal is a result, not a crash
        traceback.print_exc()
        result = {"loaded": False, "error": one_line(error)}
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1:])
