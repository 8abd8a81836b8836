"""vLLM's side of ``bench.bench_vs_vllm``: run in vLLM's own virtual environment, not osd's.

Reads a JSON job on stdin ({"model", "prompts": [[ids]], "max_tokens", "rounds",
"batches": [1, 16], "speculative": {...} or null}), generates greedily with ``ignore_eos``
from token-id prompts (no tokenizer: both engines see the same ids), prints one JSON line per
batch size: {"batch", "tokens", "seconds": [per round]}. Only the standard library and vLLM.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if job.get("speculative"):
        kwargs["speculative_config"] = job["speculative"]
    llm = LLM(
        model=job["model"],
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=job.get("max_model_len", 256),
        max_num_seqs=max(job["batches"]),
        seed=0,
        gpu_memory_utilization=job.get("memory_fraction", 0.3),  # on the CPU: of RAM
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[: max(job["batches"])], params, use_tqdm=False)  # warm-up
    for batch in job["batches"]:
        seconds, tokens = [], 0
        for _ in range(job["rounds"]):
            tokens = 0
            started = time.perf_counter()
            for i in range(0, len(prompts), batch):
                outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            seconds.append(time.perf_counter() - started)
        print(json.dumps({"batch": batch, "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
