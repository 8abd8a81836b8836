"""Measurements of the demo pair: perplexity, decode cost, acceptance and throughput.

Shared by ``osd demo-models report`` and ``bench/bench_demo_models.py``. Timings take the
minimum over repeats, since a shared CI machine only ever adds noise on top of the true cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from osd.decode.engine import SpeculativeDecoder
from osd.decode.models import CausalLM

__all__ = [
    "AcceptanceResult",
    "ThroughputResult",
    "decode_step_ms",
    "greedy_continuation",
    "measure_acceptance",
    "measure_throughput",
    "perplexity",
]


@torch.inference_mode()
def perplexity(
    model: Any, tokenizer: Any, texts: Sequence[str], *, max_len: int, batch_size: int = 8
) -> float:
    """exp(mean next-token NLL) over ``<|bos|> text <|endoftext|>``, each cut to ``max_len``.

    Args:
        model: a causal LM (base or peft).
        tokenizer: the shared tokenizer (adds ``<|bos|>``).
        texts: held-out documents.
        max_len: tokens per document at most (the model's context).
        batch_size: documents per forward.
    """
    if not texts:
        raise ValueError("perplexity needs at least one text")
    encoded = [row + [tokenizer.eos_token_id] for row in tokenizer(list(texts))["input_ids"]]
    encoded = [row[:max_len] for row in encoded]
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start : start + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
        logits = model(input_ids=ids, attention_mask=mask.long()).logits.float()  # (B, T, V)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        keep = mask[:, 1:].flatten()
        total_nll += float(nll[keep].sum())
        total_tokens += int(keep.sum())
    return math.exp(total_nll / total_tokens)


@torch.inference_mode()
def decode_step_ms(
    model: Any, *, context_len: int = 64, num_steps: int = 16, repeats: int = 12
) -> float:
    """Milliseconds of one 1-token decode step with a KV cache (min over repeats of the mean).

    Calls the model exactly as the engine does (:class:`osd.decode.models.CausalLM`).
    """
    lm = CausalLM(model, model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, lm.vocab_size, (1, context_len), generator=gen)
    token = torch.tensor([[5]])
    best = math.inf
    for _ in range(repeats):
        cache = lm.new_cache()
        lm.logits(prompt, cache, num_logits=1)
        started = time.perf_counter()
        for _ in range(num_steps):
            lm.logits(token, cache, num_logits=1)
        best = min(best, (time.perf_counter() - started) / num_steps)
    return best * 1e3


@dataclass
class AcceptanceResult:
    """Pooled over prompts: accepted / drafted, and tokens emitted per target call."""

    acceptance_rate: float
    tokens_per_step: float
    num_generated: int
    num_prompts: int


def measure_acceptance(
    engine: SpeculativeDecoder,
    prompts: Sequence[str],
    *,
    temperature: float,
    max_tokens: int = 48,
    num_spec_tokens: int = 4,
    method: str = "block",
    adapter: str | None = None,
    seed: int = 0,
) -> AcceptanceResult:
    """Runs the engine on each prompt (seeded) and pools its acceptance statistics."""
    drafted = accepted = generated = steps = 0
    for i, prompt in enumerate(prompts):
        result = engine.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            method=method,  # type: ignore[arg-type]
            num_spec_tokens=num_spec_tokens,
            adapter=adapter,
            seed=seed + i,
            log=False,
        )
        drafted += result.stats.drafted
        accepted += result.stats.accepted
        generated += result.stats.num_generated
        steps += result.stats.steps
    return AcceptanceResult(
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_step=generated / steps if steps else 0.0,
        num_generated=generated,
        num_prompts=len(prompts),
    )


@torch.inference_mode()
def _target_only(engine: SpeculativeDecoder, prompt_ids: list[int], max_tokens: int) -> int:
    """Plain greedy decoding with the target alone, one token per forward; returns tokens made."""
    target, eos = engine.target, engine.tokenizer.eos_token_id
    cache = target.new_cache()
    pending = torch.tensor([prompt_ids], device=engine.device)
    for made in range(1, max_tokens + 1):
        token = target.logits(pending, cache, num_logits=1)[0, -1].argmax()
        if int(token) == eos:
            return made
        pending = token.view(1, 1)
    return max_tokens


@dataclass
class ThroughputResult:
    """Greedy decoding tokens per second: the target alone versus speculative decoding."""

    target_only_tokens_per_s: float
    speculative_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.target_only_tokens_per_s


def measure_throughput(
    engine: SpeculativeDecoder,
    prompts: Sequence[str],
    *,
    max_tokens: int = 48,
    num_spec_tokens: int = 4,
    adapter: str | None = None,
    repeats: int = 2,
) -> ThroughputResult:
    """Greedy tokens/s of both ways, interleaved per prompt so machine noise hits both alike.

    Each prompt runs ``repeats`` times each way and its fastest run counts.
    """
    plain_s = spec_s = 0.0
    plain_tokens = spec_tokens = 0
    for prompt in prompts:
        prompt_ids = list(engine.tokenizer(prompt)["input_ids"])
        best_plain = best_spec = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            made = _target_only(engine, prompt_ids, max_tokens)
            best_plain = min(best_plain, time.perf_counter() - started)
            started = time.perf_counter()
            result = engine.generate(
                prompt_ids,
                max_tokens=max_tokens,
                temperature=0,
                num_spec_tokens=num_spec_tokens,
                adapter=adapter,
                log=False,
            )
            best_spec = min(best_spec, time.perf_counter() - started)
        plain_s, plain_tokens = plain_s + best_plain, plain_tokens + made
        spec_s, spec_tokens = spec_s + best_spec, spec_tokens + result.stats.num_generated
    return ThroughputResult(plain_tokens / plain_s, spec_tokens / spec_s)


def greedy_continuation(engine: SpeculativeDecoder, prompt: str, max_tokens: int = 48) -> str:
    """The target's greedy continuation (speculative decoding is exact at temperature 0)."""
    return engine.generate(prompt, max_tokens=max_tokens, temperature=0, log=False).text
