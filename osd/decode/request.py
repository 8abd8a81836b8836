"""One request's settings: validated once, frozen, and carried unchanged to its log record.

:meth:`osd.decode.engine.SpeculativeDecoder.prepare` builds the value from the Python API's or
the HTTP API's arguments (the edge); the batched loop decodes by it; the finished request's
:class:`osd.decode.generation.GenerationLog` holds the same value, and its ``to_record`` reads the
record's settings from it. Nothing restates the settings on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from osd.decode.grammar import Grammar
from osd.decode.methods import Method, ProposerChoice
from osd.decode.sampling import SamplingParams

__all__ = ["DecodeRequest"]


@dataclass(frozen=True)
class DecodeRequest:
    """Validated arguments of one generation (built by ``SpeculativeDecoder``)."""

    prompt_ids: tuple[int, ...]
    seed: int
    max_new_tokens: int
    params: SamplingParams
    method: Method
    num_spec_tokens: int
    num_drafts: int
    adapter: str | None
    stop_token_ids: frozenset[int]
    log_top_m: int | None
    adaptive_threshold: float
    stop: tuple[str, ...]
    # k chosen per step by the goodput controller (at most num_spec_tokens); route: the
    # statistics key beside the adapter (e.g. the request's domain).
    auto_spec: bool = False
    route: str = ""
    # Alternatives per token of OpenAI's logprobs (0..20); None: no logprobs.
    logprobs: int | None = None
    # Structured output: every token is masked by this grammar (osd.decode.grammar); None: free
    # text.
    grammar: Grammar | None = None
    # The same for each prompt token (OpenAI's echo with logprobs); None: none.
    prompt_logprobs: int | None = None
    # Who drafts (osd.decode.proposers): the controller's choice per step, or one pinned.
    proposer: ProposerChoice = "auto"

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
