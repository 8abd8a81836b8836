"""Engine benchmark: target-only generate, HF assisted generation and osd, in one process.

Prints tokens/s, measured acceptance, tokens per target call against the theory
(1 - a^(k+1)) / (1 - a), and every speed as a ratio to HF assisted generation with the same
pair and k. Run: ``python -m bench.bench_engine`` (demo pair if built, else a synthetic pair)
or ``python -m bench.bench_engine --target PATH --draft PATH``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from bench.cpu import add_threads_argument, apply_bench_threads
from osd import SpeculativeDecoder
from osd.testing import tiny_llama


def synthetic_pair(vocab_size: int = 2048) -> tuple[Any, Any, str]:
    """A random target whose later layers barely move the residual stream, and a draft made
    of its first layer (embeddings and head shared): correlated like a distilled pair."""
    target = tiny_llama(
        vocab_size=vocab_size, hidden_size=512, num_layers=10, seed=0, logit_scale=3.0
    )
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    config = target.config.to_dict() | {"num_hidden_layers": 1}
    draft = LlamaForCausalLM(type(target.config)(**config))
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, draft.eval(), "synthetic (random 10-layer target, its first layer as draft)"


def demo_pair() -> tuple[Any, Any, str] | None:
    """The trained demo pair if it is already built (never builds it here)."""
    from osd.model_sources import find_demo_models

    paths = find_demo_models()
    if paths is None:
        return None
    target = AutoModelForCausalLM.from_pretrained(paths.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(paths.draft).eval()
    return target, draft, f"demo pair ({paths.root})"


def forward_ms(model: Any, prompt: torch.Tensor, repeats: int = 30) -> float:
    """Median time of a 1-token decode step with a KV cache of the prompt."""
    with torch.inference_mode():
        out = model(prompt, use_cache=True)
        cache, token = out.cache if hasattr(out, "cache") else out.past_key_values, prompt[:, -1:]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-1)
    return 1000 * statistics.median(times)


def timed(fn: Callable[[], int], repeats: int) -> float:
    """Best tokens/s over repeats (best of n filters noise from the shared machine)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        num_tokens = fn()
        best = max(best, num_tokens / (time.perf_counter() - start))
    return best


def theory(alpha: float, k: int) -> float:
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ks", default="2,4,8")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    threads = apply_bench_threads(args.threads)
    if args.target and args.draft:
        target = AutoModelForCausalLM.from_pretrained(args.target).eval()
        draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()
        name = f"{args.target} / {args.draft}"
    else:
        target, draft, name = demo_pair() or synthetic_pair()
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (1, 24), generator=gen) for _ in range(args.prompts)]
    n = args.max_tokens
    engine = SpeculativeDecoder(target, draft)
    t_ms, d_ms = forward_ms(target, prompts[0]), forward_ms(draft, prompts[0])
    print(f"pair: {name}")
    print(f"decode forward: target {t_ms:.2f} ms, draft {d_ms:.2f} ms, ratio {t_ms / d_ms:.1f}x")
    print(
        f"greedy, {len(prompts)} prompts x {n} new tokens, best of {args.repeats}, "
        f"{threads} threads\n"
    )

    def hf(assistant: Any = None, k: int = 0) -> Callable[[], int]:
        def run() -> int:
            total = 0
            for p in prompts:
                kwargs: dict[str, Any] = {}
                if assistant is not None:
                    assistant.generation_config.num_assistant_tokens = k
                    assistant.generation_config.num_assistant_tokens_schedule = "constant"
                    assistant.generation_config.assistant_confidence_threshold = 0.0
                    kwargs["assistant_model"] = assistant
                out = target.generate(
                    p, do_sample=False, max_new_tokens=n, min_new_tokens=n, **kwargs
                )
                total += out.shape[1] - p.shape[1]
            return total

        return run

    def osd_run(method: str, k: int, stats: list, log: bool = True) -> Callable[[], int]:
        def run() -> int:
            stats.clear()
            for p in prompts:
                r = engine.generate(
                    p[0].tolist(),
                    max_tokens=n,
                    temperature=0,
                    method=method,
                    num_spec_tokens=k,
                    stop_token_ids=[],
                    log=log,
                )
                stats.append(r.stats)
            return sum(s.num_generated for s in stats)

        return run

    with torch.inference_mode():
        base = timed(hf(), args.repeats)
        print(
            f"{'system':<26}{'k':>3}{'tok/s':>9}{'accept':>8}{'tok/call':>10}{'theory':>8}"
            f"{'vs HF-asst':>11}{'vs target':>10}"
        )
        print(
            f"{'HF generate (target)':<26}{'-':>3}{base:>9.1f}{'':>8}{'1.00':>10}{'':>8}"
            f"{'':>11}{1.0:>10.2f}"
        )
        for k in [int(x) for x in args.ks.split(",")]:
            assisted = timed(hf(draft, k), args.repeats)
            print(
                f"{'HF assisted generation':<26}{k:>3}{assisted:>9.1f}{'':>8}{'':>10}{'':>8}"
                f"{1.0:>11.2f}{assisted / base:>10.2f}"
            )
            for method in ("token", "block", "spectr"):
                stats: list = []
                speed = timed(osd_run(method, k, stats), args.repeats)
                drafted = sum(s.drafted for s in stats)
                alpha = sum(s.accepted for s in stats) / drafted
                per_call = sum(s.num_generated for s in stats) / sum(s.steps for s in stats)
                print(
                    f"{'osd ' + method:<26}{k:>3}{speed:>9.1f}{alpha:>8.2f}{per_call:>10.2f}"
                    f"{theory(alpha, k):>8.2f}{speed / assisted:>11.2f}{speed / base:>10.2f}"
                )
        with_log = timed(osd_run("block", 4, [], log=True), args.repeats)
        without_log = timed(osd_run("block", 4, [], log=False), args.repeats)
        print(
            f"\nlog data collection (block, k=4): {with_log:.1f} tok/s with, "
            f"{without_log:.1f} without: {100 * (without_log / with_log - 1):+.1f}% decode time"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
