"""osd's engine on a GPU: the target alone eager, compiled and with CUDA graphs, beside HF
``generate`` on the same model, prompts and device; speculation (block verification, k 4,
the draft model drafting) on top.

The models are built in code, randomly initialised, on the device in its dtype (bf16 on CUDA):
a target of a small production model's shape (Llama-3.2-1B's: hidden 2048, 16 layers, 32
query and 8 key/value heads; ``--target-layers``, ``--hidden`` to change it) and a 4-layer
draft of hidden 512 with the same vocabulary. Random weights give a random draft's
acceptance, so the speculative rows measure what speculation costs more than what it buys.
Prompts are random token ids (``--prompt-tokens``); every request generates exactly
``--max-tokens`` greedy tokens (no end of sequence), one request at a time (batch 1) and 16 at a
time (batch 16). Each engine is warmed up (``osd.decode.warmup``, and a round of the bench's
own) before its timed rounds; medians of ``--rounds`` rounds are printed, with each variant's
tokens/s over HF ``generate``'s at the same batch size.

Run on a machine with a GPU: ``python -m bench.bench_cuda`` (``--help`` for options); it says
so and exits where CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_vs_vllm import osd_round
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.decode.compiled_forward import compile_stats
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up

BATCHES = (1, 16)
# engine name -> SpeculativeDecoder keywords
ENGINES: dict[str, dict[str, Any]] = {
    "eager": {"compile_forward": False, "cuda_graphs": False},
    "graphs": {"compile_forward": False, "cuda_graphs": True},
    "compiled": {"compile_forward": True, "cuda_graphs": False},
    "compiled+graphs": {"compile_forward": True, "cuda_graphs": True},
}
OPTIONS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "block k4": {"method": "block", "proposer": "draft", "num_spec_tokens": 4},
}


def build_model(
    hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int, device: str
) -> Any:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def hf_round(model: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """HF ``generate``, greedy, exactly ``max_tokens`` new tokens a prompt; tokens/s."""
    tokens = 0
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--target-layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES), help="of " + ", ".join(ENGINES))
    parser.add_argument("--speculative", action="store_true", help="add block k4 rows")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: CUDA is not available on this machine; nothing to measure.")
        return 0
    device = "cuda"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    target = build_model(
        args.hidden, args.target_layers, args.hidden // 64, 8, args.vocab, 0, device
    )
    draft = build_model(512, 4, 8, 8, args.vocab, 1, device)
    generator = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, args.vocab, (32, args.prompt_tokens), generator=generator).tolist()
    options = OPTIONS if args.speculative else {"none": OPTIONS["none"]}
    rounds: dict[str, dict[int, list[float]]] = {}
    if not args.no_hf:
        hf_round(target, prompts[:2], 2, 8)  # warm-up
        rounds["HF generate"] = {
            b: [
                hf_round(target, prompts[: 4 if b == 1 else 32], b, args.max_tokens)
                for _ in range(args.rounds)
            ]
            for b in BATCHES
        }
        print(f"HF generate: {rounds['HF generate']}", flush=True)
    for name in args.engines.split(","):
        before, captured = compile_stats().compilations, compile_stats().captures
        started = time.perf_counter()
        decoder = SpeculativeDecoder(target, draft, None, **ENGINES[name])
        engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=max(BATCHES)))
        report = warm_up(engine)
        for option in options.values():
            osd_round(engine, decoder, prompts[:16], 16, 8, option)
        ready = time.perf_counter() - started
        print(f"osd {name}: ready in {ready:.1f} s ({report.describe()})", flush=True)
        for label, option in options.items():
            key = f"osd {name}, {label}"
            rounds[key] = {
                b: [
                    osd_round(
                        engine, decoder, prompts[: 4 if b == 1 else 32], b, args.max_tokens, option
                    )
                    for _ in range(args.rounds)
                ]
                for b in BATCHES
            }
            print(f"{key}: {rounds[key]}", flush=True)
        compilations = compile_stats().compilations - before
        captures = compile_stats().captures - captured
        print(f"osd {name}: {compilations} graphs compiled, {captures} CUDA graphs", flush=True)
        engine.close()
        del engine, decoder
        torch.cuda.empty_cache()
    medians = {k: {b: statistics.median(v[b]) for b in BATCHES} for k, v in rounds.items()}
    peer = medians.get("HF generate")
    rows = []
    for key, by_batch in medians.items():
        row = [key]
        for b in BATCHES:
            row.append(f"{by_batch[b]:,.0f}")
            row.append("" if peer is None else f"{by_batch[b] / peer[b]:.2f}x")
        rows.append(row)
    title = f"osd on {torch.cuda.get_device_name()}, target alone and block k4 beside HF generate"
    print_table(title, ["generated tok/s", "b1", "/ HF", "b16", "/ HF"], rows)
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "args": vars(args) | {"json": None}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
