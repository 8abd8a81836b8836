"""vLLM's side of ``bench.bench_vs_vllm``: run in vLLM's own virtual environment, not osd's.

Reads a JSON job on its first stdin line ({"model", "prompts": [[ids]], "max_tokens",
"max_num_seqs", "speculative": {...} or null}), builds vLLM's offline engine on it, prints
``{"ready": ...}``, then answers each further line (a batch size) with one JSON line
{"batch", "tokens", "seconds"}: every prompt generated greedily with ``ignore_eos``, ``batch``
at a time, from token ids (no tokenizer: both engines see the same ids). Being driven a round at
a time lets the bench pair each vLLM round with an osd round on the same noisy machine. Only the
standard library and vLLM.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if job.get("speculative"):
        kwargs["speculative_config"] = job["speculative"]
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=job.get("max_model_len", 256),
        max_num_seqs=job["max_num_seqs"],
        seed=0,
        gpu_memory_utilization=job.get("memory_fraction", 0.3),  # on the CPU: of RAM
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[: job["max_num_seqs"]], params, use_tqdm=False)  # warm-up
    print(json.dumps({"ready": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        batch = int(line)
        tokens = 0
        started = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        seconds = time.perf_counter() - started
        print(json.dumps({"batch": batch, "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
