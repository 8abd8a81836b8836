"""A decode loop's warm-up before it serves: each batch size's steps run once, then forgotten.

The first forwards of a shape are slow on every device (oneDNN's primitive caches and the
allocator on a CPU; cuBLAS's heuristics and the caching allocator's pools on a GPU): a cold
replica's first steps on the demo pair took 26-44 ms against 5-10 once warm, and its first
clients paid for them. :func:`warm_up` sends synthetic requests (token ids, no text) through
the loop at every power-of-two batch size up to ``max_num_seqs`` (and that size itself): one
round drafted as served requests are (``"auto"``: the controller's choice, the model-free
proposers included; greedy and sampled rows; the bare draft and, where the draft has adapters,
one of them), one where the draft model drafts for rows all on one adapter (its merged
forwards at that batch size, which a served round may leave to the lookups), then one with
the target alone. Its steps go to a throwaway controller and proposers: the replica's costs,
acceptance and suffix store start from its own traffic. The requests are never logged (no
record is written outside the replica's runtime). With ``model.compile`` the warm-up is also
when every graph is compiled
(:mod:`osd.decode.compiled_forward`): each model first runs one forward of every shape its
graphs take (:meth:`osd.decode.models.CausalLM.compile_graphs`: one and several rows, one
token a row, a verify step's few, packed too, and a prompt's many), so none depends on which
shapes the rounds happen to reach.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from osd.decode.compiled_forward import compile_stats
from osd.decode.goodput import GoodputController
from osd.decode.loop import BatchedEngine, LoopStats
from osd.decode.methods import Method
from osd.decode.options import RequestOptions
from osd.decode.proposers import Proposers
from osd.decode.request import DecodeRequest
from osd.decode.sampling import SamplingParams

if TYPE_CHECKING:
    from osd.decode.engine import SpeculativeDecoder

__all__ = ["WarmupReport", "warm_up", "warmup_batch_sizes"]

log = logging.getLogger(__name__)

_MOTIF = 8  # a prompt repeats a motif of this many tokens: the lookups find continuations
_PROMPT_TOKENS = 32
# Rounds at each batch size: speculation as served (the controller's k, lookups included,
# adapters mixed per row), the draft model drafting for rows all on one adapter (its merged
# forwards at that batch size; a served round may never run the draft model over several rows,
# its lookups drafting instead), uneven lookups (even rows verify a looked-up token a step,
# their answers of the rounds before replayed, odd rows none: the packed verify forward at that
# batch size, whose shape class settles compiled or eager in 8 timed calls; the served round's
# controller may verify no lookups at 16 rows, and those trials then ran on served traffic at
# ~13 ms a call), then the target alone. Which graphs compile does not depend on them
# (CausalLM.compile_graphs runs first).
RoundKind = Literal["served", "draft", "uneven lookups"]
_ROUNDS: tuple[tuple[Method, RoundKind], ...] = (
    ("block", "served"),
    ("block", "draft"),
    ("block", "uneven lookups"),
    ("none", "served"),
)


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up ran: its batch sizes, requests, steps and seconds (0 requests: none)."""

    batch_sizes: tuple[int, ...]
    requests: int
    steps: int
    seconds: float
    failed: int = 0
    compilations: int = 0  # graphs torch.compile compiled meanwhile (model.compile)
    captures: int = 0  # CUDA graphs captured meanwhile (model.cuda_graphs)

    def describe(self) -> str:
        if not self.requests:
            return "engine warm-up skipped"
        notes = f", {self.failed} failed" if self.failed else ""
        if self.compilations:
            notes += f", {self.compilations} graphs compiled"
        if self.captures:
            notes += f", {self.captures} CUDA graphs captured"
        return (
            f"engine warm-up: {self.requests} requests, {self.steps} steps at batch sizes "
            f"{', '.join(map(str, self.batch_sizes))} in {self.seconds:.1f} s{notes}"
        )


def warmup_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_seqs)


def warm_up(engine: BatchedEngine) -> WarmupReport:
    """Runs the warm-up rounds through ``engine`` and waits for them; call it before the engine
    takes requests (its controller and proposers are swapped for throwaway ones meanwhile).
    A request that fails is counted and logged, never raised: warm-up only saves time. The
    loop's counters start again after it (its metrics count served steps only)."""
    decoder = engine.decoder
    k = decoder.max_spec_tokens
    max_tokens = min(2 * (k + 1), engine.max_len // 4)
    prompt_tokens = min(_PROMPT_TOKENS, engine.max_len - max_tokens - 1)
    sizes = tuple(
        s for s in warmup_batch_sizes(engine.limits.max_num_seqs) if s <= engine.limits.max_waiting
    )
    if max_tokens < 1 or prompt_tokens < 2 or not sizes:
        return WarmupReport((), 0, 0, 0.0)
    adapter = decoder.adapters[0] if decoder.adapters else None
    pair = engine.pair
    kept = pair.controller, pair.proposers
    pair.controller = GoodputController(max_k=k)
    pair.proposers = Proposers(kept[1].settings)
    started, steps, num_requests, failed = time.perf_counter(), engine.stats.steps, 0, 0
    compiled_before, captured_before = compile_stats().compilations, compile_stats().captures
    for model in (decoder.target, decoder.draft):
        try:
            model.compile_graphs()
        except Exception:  # noqa: BLE001 - logged; a graph it missed compiles when first run
            log.exception("compiling a model's graphs before the warm-up's requests failed")
    engine.reuse_prefixes(False)  # its rounds repeat their prompts: prefilled whole
    try:
        for size in sizes:
            for method, kind in _ROUNDS:
                requests = [
                    _request(decoder, row, method, adapter, prompt_tokens, max_tokens, kind)
                    for row in range(size)
                ]
                handles = [engine.submit(request) for request in requests]
                for handle in handles:
                    try:
                        handle.result()
                    except Exception:  # noqa: BLE001 - counted and logged, serving goes on
                        failed += 1
                        log.exception("a warm-up request failed")
                num_requests += size
    finally:
        pair.controller, pair.proposers = kept
        engine.reuse_prefixes(True)
    report = WarmupReport(
        sizes,
        num_requests,
        engine.stats.steps - steps,
        time.perf_counter() - started,
        failed,
        compile_stats().compilations - compiled_before,
        compile_stats().captures - captured_before,
    )
    engine.stats = LoopStats()
    return report


def _request(
    decoder: SpeculativeDecoder,
    row: int,
    method: Method,
    adapter: str | None,
    prompt_tokens: int,
    max_tokens: int,
    kind: RoundKind = "served",
) -> DecodeRequest:
    """Row ``row`` of a round: sampled on odd rows, an adapter's draft on every fourth;
    ``kind`` (:data:`_ROUNDS`): ``draft``: the draft model drafts (k at most), every row on
    ``adapter``; ``uneven lookups``: even rows' drafts looked up (one token a step:
    suffix decoding replays the same greedy rows' answers of the rounds before), odd rows
    the target alone."""
    by_draft = kind == "draft"
    lookups = kind == "uneven lookups" and row % 2 == 0
    if kind == "uneven lookups" and not lookups:
        method = "none"
    quarter = max(decoder.vocab_size // 4, 1)  # ids from the vocabulary's second quarter
    motif = [quarter + (row * 131 + i * 37) % quarter for i in range(_MOTIF)]
    prompt = (motif * (prompt_tokens // _MOTIF + 1))[:prompt_tokens]
    options = RequestOptions(
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=1.0 if row % 2 else 0.0),
        stop_token_ids=(),
        seed=row,
        method=method,
        adapter=adapter if by_draft or row % 4 == 3 else None,
        proposer="draft" if by_draft else "suffix" if lookups else "auto",
        # One looked-up token a step: the replays last 9+ steps, the 8 calls a shape
        # class's trials take (k + 1 = 2 positions is the same class as any width <= 16).
        num_spec_tokens=decoder.max_spec_tokens if by_draft else 1 if lookups else "auto",
        log=True,  # the target's top-m of the log runs on served steps: warmed too
        route="warm-up",
    )
    return decoder.prepare(prompt, options)
