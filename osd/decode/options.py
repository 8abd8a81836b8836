"""One request's options: the single value from the edge to the engine.

:class:`RequestOptions` is what a caller asks of one generation, with the defaults, built once
at the edge: from an HTTP request by ``serving.protocol`` (fields of the same name are taken
over by name, so an OpenAI sampling field that osd adds is declared on the request model and
here, and used where it matters, nothing else), or from the Python API's keywords
(:meth:`RequestOptions.of`, behind :meth:`osd.decode.engine.SpeculativeDecoder.prepare`). The
engine validates it and carries it unchanged in its :class:`osd.decode.request.DecodeRequest`
(``request.options``) beside what it derives from it (the resolved seed, the sampling
parameters, the tokens that end generation ...), which the generation log and the record read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from osd.decode.grammar import Grammar
from osd.decode.methods import Method, ProposerChoice
from osd.decode.request_checks import check_options
from osd.decode.sampling import SamplingParams
from osd.errors import ParamError

__all__ = ["OPTION_NAMES", "SAMPLING_NAMES", "RequestOptions"]


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks for.

    Attributes:
        max_tokens: most tokens to generate; 0 runs only the prefill (prompt scoring with
            ``prompt_logprobs``; such a request is not logged).
        fit_context: ``max_tokens`` is a most: fewer where the context has less room after the
            prompt. False: a prompt and ``max_tokens`` that exceed the context are refused
            (a ``ParamError`` naming max_tokens), as OpenAI's and vLLM's servers refuse them.
        sampling: temperature, top-p, top-k, min-p, the penalties and the logit bias
            (:class:`osd.decode.sampling.SamplingParams`, OpenAI's and vLLM's meaning), applied
            alike to the draft and the target, so every method stays exact. As keywords of
            :meth:`of` they are given by their own names (``temperature=0``).
        stop: strings that end generation; the text is cut before them.
        stop_token_ids: token ids that end generation; None: the tokenizer's end-of-sequence.
        seed: seed of the request's random streams; None draws one.
        method: ``"token"``, ``"block"``, ``"spectr"`` or ``"none"``.
        num_spec_tokens: ``"auto"``: the goodput controller chooses k each step; or a fixed
            k >= 1 drafted every step.
        num_drafts: draft sequences for spectr, K >= 1.
        adapter: the draft's LoRA adapter; None: the base draft.
        log: collect the request's log data (its record).
        route: what the controller's statistics are kept by beside the adapter (e.g. the
            request's domain).
        logprobs: each emitted token's logprob and this many alternatives (0..20); None: none.
        prompt_logprobs: the same for each prompt token, from the prefill; None: none.
        grammar: structured output (:mod:`osd.decode.grammar`); None: free text.
        proposer: who drafts (:mod:`osd.decode.proposers`): ``"auto"``, ``"draft"``,
            ``"suffix"`` or ``"ngram"``.
        skip_special_tokens: the text leaves the tokenizer's special tokens out (vLLM's
            default); false writes them (a tool-call marker that is a special token, e.g.
            Mistral's ``[TOOL_CALLS]``). The tokens that ended generation are never written.
    """

    max_tokens: int = 128
    fit_context: bool = True
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    method: Method = "block"
    num_spec_tokens: int | Literal["auto"] = "auto"
    num_drafts: int = 2
    adapter: str | None = None
    log: bool = True
    route: str = ""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    proposer: ProposerChoice = "auto"
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, base: RequestOptions | None = None, **keywords: Any) -> RequestOptions:
        """``base`` (default: the defaults) with ``keywords`` over it, the sampling parameters
        by their own names, in the Python API's looser spellings: ``logit_bias`` a mapping,
        ``stop`` one string, ids any sequence.

        The value is checked (:meth:`check`) either way; ``base`` alone comes back unchanged.

        Raises:
            ParamError: a keyword that is not an option, or a value out of range.
        """
        if not keywords and base is not None:
            base.check()
            return base  # carried unchanged
        base = base or cls()
        unknown = sorted(set(keywords) - OPTION_NAMES)
        if unknown:
            raise ParamError(unknown[0], f"{unknown[0]!r} is not a request option")
        sampling = {name: keywords.pop(name) for name in SAMPLING_NAMES & set(keywords)}
        stop = keywords.get("stop")
        if "stop" in keywords:
            keywords["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        ids = keywords.get("stop_token_ids")
        if isinstance(ids, Sequence):
            keywords["stop_token_ids"] = tuple(ids)
        options = dataclasses.replace(base, **keywords)
        options.check()  # before the sampling values: the first bad argument is named
        if sampling.get("logit_bias", ()) is None:
            sampling.pop("logit_bias")
        if not sampling:
            return options
        return dataclasses.replace(options, sampling=dataclasses.replace(base.sampling, **sampling))

    def check(self) -> None:
        """Raises :class:`ParamError` for a method, proposer, k, K, token budget or logprobs out
        of range (the sampling values are checked by ``SamplingParams`` itself)."""
        check_options(
            method=self.method,
            num_spec_tokens=1 if self.num_spec_tokens == "auto" else self.num_spec_tokens,
            num_drafts=self.num_drafts,
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            proposer=self.proposer,
        )


SAMPLING_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# What a request may set by name: its options, the sampling parameters by their own names.
OPTION_NAMES = (
    frozenset(f.name for f in dataclasses.fields(RequestOptions)) - {"sampling"}
) | SAMPLING_NAMES
