"""One request, validated: its options as given, carried unchanged, and what the engine derives.

:meth:`osd.decode.engine.SpeculativeDecoder.prepare` validates the caller's
:class:`osd.decode.options.RequestOptions` (built once at the edge: the HTTP request or the
Python API's keywords) and keeps it as ``options``, beside what it derives: the prompt's ids,
the resolved seed, the sampling parameters, the tokens that end generation, the chosen adapter.
The batched loop decodes by the value; the finished request's
:class:`osd.decode.generation.GenerationLog` holds the same value, and its ``to_record`` reads
the record's settings from it. Nothing restates the options on the way: the ones used as given
are read through properties.
"""

from __future__ import annotations

from dataclasses import dataclass

from osd.decode.grammar import Grammar
from osd.decode.methods import Method, ProposerChoice
from osd.decode.options import RequestOptions
from osd.decode.sampling import SamplingParams

__all__ = ["DecodeRequest"]


@dataclass(frozen=True)
class DecodeRequest:
    """A validated request (built by ``SpeculativeDecoder.prepare``).

    Attributes:
        options: the options as the caller gave them.
        prompt_ids: the prompt's token ids.
        seed: the seed of its random streams (drawn when the options name none).
        max_new_tokens: tokens it may generate (``max_tokens`` within the context).
        num_spec_tokens: the most tokens drafted a step (``max_spec_tokens`` with ``"auto"``).
        num_drafts: draft sequences (1 when greedy: greedy drafts would all be identical).
        adapter: the draft's adapter it decodes with (serving: the leased version).
        stop_token_ids: the tokens that end it (end-of-sequence by default; with a grammar,
            also the grammar's end).
        log_top_m: target tokens logged per position; None: not logged.
        adaptive_threshold: the engine's early stop of drafting.
        auto_spec: k chosen per step by the goodput controller (at most num_spec_tokens).
        base_weights: the adapter's weights are the base draft's (serving: every adapter's
            version 0, identity-initialised), so its drafts count toward the base draft's
            acceptance and its draft forwards run without the adapter (it adds exactly zero).
    """

    options: RequestOptions
    prompt_ids: tuple[int, ...]
    seed: int
    max_new_tokens: int
    num_spec_tokens: int
    num_drafts: int
    adapter: str | None
    stop_token_ids: frozenset[int]
    log_top_m: int | None
    adaptive_threshold: float
    auto_spec: bool = False
    base_weights: bool = False

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters."""
        return self.options.sampling

    @property
    def method(self) -> Method:
        return self.options.method

    @property
    def fit_context(self) -> bool:
        """``max_new_tokens`` may be cut to an engine's shorter context (else refused)."""
        return self.options.fit_context

    @property
    def stop(self) -> tuple[str, ...]:
        return self.options.stop

    @property
    def skip_special_tokens(self) -> bool:
        """The text leaves special tokens out."""
        return self.options.skip_special_tokens

    @property
    def route(self) -> str:
        """The statistics key beside the adapter (e.g. the request's domain)."""
        return self.options.route

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token of OpenAI's logprobs (0..20); None: no logprobs."""
        return self.options.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        """The same for each prompt token (OpenAI's echo with logprobs); None: none."""
        return self.options.prompt_logprobs

    @property
    def grammar(self) -> Grammar | None:
        """Structured output: every token is masked by this grammar; None: free text."""
        return self.options.grammar

    @property
    def proposer(self) -> ProposerChoice:
        """Who drafts (osd.decode.proposers): the controller's choice per step, or one pinned."""
        return self.options.proposer

    @property
    def num_slots(self) -> int:
        """KV slots the request holds: one per draft sequence."""
        return self.num_drafts if self.method == "spectr" else 1

    @property
    def verifier(self) -> str:
        """The verifier of its steps: ``none`` rows verify zero drafted tokens with ``token``."""
        if self.method == "block":
            return "block"
        if self.method == "spectr" and self.num_drafts > 1:
            return "spectr"
        return "token"
