"""The speculative decoding engine: a draft model proposes, the target verifies in one forward.

Every request runs through the batched step of :mod:`osd.decode` (a library call is a batch of
one; a replica's :class:`osd.decode.loop.BatchedEngine` steps all its requests together). Both
models keep KV caches across steps; on rejection a row's cache length is cut back to the kept
prefix, so the prefix is never recomputed. The verifiers (:mod:`osd.decode.verification`) keep the
output distribution exactly the target's. Random streams for drafting and for verification are
separate and seeded per request. Papers: Leviathan et al. 2023 (arXiv 2211.17192), SpecTr
(arXiv 2310.15141), Block Verification (arXiv 2403.10444).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import PreTrainedModel

from osd.decode.attention_probe import check_cached_forward
from osd.decode.choices import choice_requests
from osd.decode.forward import ModelPair
from osd.decode.generation import GenerationResult, StreamChunk
from osd.decode.goodput import GoodputController
from osd.decode.grammar import GrammarCompiler
from osd.decode.kv_cache import SlotKVCache
from osd.decode.limits import MAX_SPEC_TOKENS
from osd.decode.methods import Method
from osd.decode.models import CausalLM, load_causal_lm, load_tokenizer
from osd.decode.options import RequestOptions
from osd.decode.proposers import LookupSettings, Proposers, SuffixScope
from osd.decode.request import DecodeRequest
from osd.decode.request_checks import check_bias, fitted_budget, prompt_ids
from osd.decode.rows import Row
from osd.decode.step import VERIFIERS, prefill, run_step

__all__ = ["VERIFIERS", "GenerationStream", "Method", "RequestOptions", "SpeculativeDecoder"]


class SpeculativeDecoder:
    """Lossless speculative decoding over a Hugging Face target/draft pair.

    Args:
        target: the large model (object, local path or hub id).
        draft: the small model sharing the target's vocabulary; may be a peft model with
            several named LoRA adapters, chosen per call with ``adapter=``.
        tokenizer: shared tokenizer; loaded from ``target`` when that is a path and None given.
        device: device for models given as paths (e.g. ``"cuda"``); None: CUDA if available.
        dtype: dtype for models given as paths (e.g. ``"bfloat16"``); None: the checkpoint's.
        log_top_m: how many of the target's most likely tokens to log per position.
        max_spec_tokens: the largest k the goodput controller may choose (``"auto"``).
        adaptive_threshold: stop drafting after a token whose draft probability is below this
            (0 disables); the decision depends only on the draft, so outputs stay exact.
        suffix_budget: tokens of finished requests the ``suffix`` proposer keeps to look
            continuations up in (oldest forgotten first); 0 keeps none (it still looks in each
            request's own tokens, as ``ngram`` does).
        suffix_scope: ``global``: one store for all requests; ``route``: one per route.
        max_lookup_tokens: the most tokens a looked-up draft verifies a step under ``"auto"``
            k (it may exceed ``max_spec_tokens``: no draft forward, see
            :class:`osd.decode.proposers.LookupSettings`).
        proposers: False: the draft model drafts every row (no model-free proposers at all).
    """

    def __init__(
        self,
        target: PreTrainedModel | str,
        draft: PreTrainedModel | str,
        tokenizer: Any = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        log_top_m: int = 32,
        adaptive_threshold: float = 0.0,
        max_spec_tokens: int = 8,
        draft_guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        check_models: bool = True,
        lean_forward: bool = True,
        compile_forward: bool = False,
        cuda_graphs: bool = False,
        merged_drafts: int = 4,
        suffix_budget: int = 500_000,
        suffix_scope: SuffixScope = "global",
        max_lookup_tokens: int = LookupSettings.max_tokens,
        proposers: bool = True,
    ) -> None:
        """``draft_guard`` is entered around every draft forward: a server that adds and removes
        LoRA adapters while decoding passes its adapters' read lock (serving.adapter_slots).

        A model the engine cannot serve exactly (a recurrent or state-space layer,
        cross-attention, an attention pattern it does not know) is refused here with
        :class:`osd.decode.attention.UnsupportedModel` (a ``ValueError``) naming the model class
        and the feature; ``check_models`` runs each model once through the KV cache against its
        own forward to catch what the config does not say (:mod:`osd.decode.attention_probe`).

        ``lean_forward`` runs the models' slot-cache forwards through
        :mod:`osd.decode.lean_forward` where their family has one (False: transformers' own
        forward, the debugging switch; outputs are the same). ``compile_forward`` compiles its
        decode layers (:mod:`osd.decode.compiled_forward`; outputs differ in the last bits).
        ``cuda_graphs``: on CUDA, those layers replay CUDA graphs (:mod:`osd.decode.cuda_graphs`;
        no effect elsewhere). ``merged_drafts``: adapters whose merged draft forward is kept
        (:class:`osd.decode.models.CausalLM`'s ``merged_limit``; 0: LoRA per row always)."""
        if tokenizer is None and isinstance(target, str):
            tokenizer = load_tokenizer(target)
        target_model = load_causal_lm(target, device=device, dtype=dtype)
        draft_model = load_causal_lm(draft, device=device, dtype=dtype)
        vocab_size = _shared_vocab_size(target_model, draft_model, tokenizer)
        self.target = CausalLM(
            target_model,
            vocab_size,
            lean=lean_forward,
            compile=compile_forward,
            cuda_graphs=cuda_graphs,
        )
        self.draft = CausalLM(
            draft_model,
            vocab_size,
            guard=draft_guard,
            lean=lean_forward,
            compile=compile_forward,
            cuda_graphs=cuda_graphs,
            merged_limit=merged_drafts,
        )
        if self.draft.device != self.target.device:
            raise ValueError(
                f"target is on {self.target.device} but draft on {self.draft.device}; "
                "put both on one device"
            )
        if check_models:
            check_cached_forward(self.target, "target")
            check_cached_forward(self.draft, "draft")
        if log_top_m < 1:
            raise ValueError(f"log_top_m must be >= 1, got {log_top_m}")
        if not 0.0 <= adaptive_threshold < 1.0:
            raise ValueError(f"adaptive_threshold must be in [0, 1), got {adaptive_threshold}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = end_of_sequence_ids(tokenizer, target_model, vocab_size)
        self.log_top_m = min(log_top_m, vocab_size)
        self.adaptive_threshold = adaptive_threshold
        if not 1 <= max_spec_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"max_spec_tokens must be in 1..{MAX_SPEC_TOKENS}, got {max_spec_tokens}"
            )
        self.max_spec_tokens = max_spec_tokens
        if not 1 <= max_lookup_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"max_lookup_tokens must be in 1..{MAX_SPEC_TOKENS}, got {max_lookup_tokens}"
            )
        # Statistics of this decoder's own generate/stream calls (a batched engine keeps its own).
        self.controller = GoodputController(max_k=max_spec_tokens)
        # Shared by its calls and its batched engines: what one request said, the next may reuse.
        settings = (
            LookupSettings(suffix_budget, suffix_scope, max_lookup_tokens) if proposers else None
        )
        self.proposers = Proposers(settings)
        positions = [m for m in (self.target.max_positions, self.draft.max_positions) if m]
        self.max_context = min(positions) if positions else None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this decoder's tokenizer (built on first
        use: reading a large vocabulary takes about a second)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammars

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the draft's LoRA adapters."""
        return self.draft.adapter_names

    def generate(
        self, prompt: str | Sequence[int], options: RequestOptions | None = None, **keywords: Any
    ) -> GenerationResult:
        """Generates a completion; options as in :meth:`prepare`."""
        return self.stream(prompt, options, **keywords).result()

    def generate_choices(
        self,
        prompt: str | Sequence[int],
        n: int,
        options: RequestOptions | None = None,
        **keywords: Any,
    ) -> list[GenerationResult]:
        """``n`` independent completions of one prompt (OpenAI's ``n``), decoded as a batch.

        The prompt is prefilled once and its KV shared by the choices; choice ``i`` decodes
        with the seed :func:`osd.decode.choices.choice_seed` ``(seed, i)``, so choice 0 equals
        :meth:`generate` with the same options. Options as in :meth:`prepare`.
        """
        requests = choice_requests(self.prepare(prompt, options, **keywords), n)
        request = requests[0]
        width = request.num_slots
        rows = [
            Row(r, self.tokenizer, slots=[i * width + j for j in range(width)])
            for i, r in enumerate(requests)
        ]
        rows[0].followers = rows[1:]
        pair = self.model_pair(width * n, len(request.prompt_ids) + request.max_new_tokens)
        prefill(pair, rows[:1], len(request.prompt_ids))
        _raise_failed(rows)
        while active := [row for row in rows if not row.done]:
            run_step(pair, active)
            _raise_failed(active)
        return [row.result() for row in rows]

    def stream(
        self, prompt: str | Sequence[int], options: RequestOptions | None = None, **keywords: Any
    ) -> GenerationStream:
        """Yields tokens as soon as they are verified; options as in :meth:`prepare`.

        Returns:
            A :class:`GenerationStream` of :class:`StreamChunk` s, one per step; the last one
            carries the finish reason.
        """
        return GenerationStream(self, self.prepare(prompt, options, **keywords))

    def model_pair(
        self,
        num_slots: int,
        max_len: int,
        controller: GoodputController | None = None,
        max_forward: int | None = None,
        whole: bool = False,
    ) -> ModelPair:
        """The models with fresh slot caches of ``num_slots`` rows of ``max_len`` positions,
        choosing ``"auto"`` k with ``controller`` (default: this decoder's).

        With ``max_forward`` (the most tokens one row sends the target in one forward), the
        target's windowed layers keep only their window and a forward's worth of positions
        (:class:`SlotKVCache`). The draft's cache keeps every position: after steps in which a
        row drafts nothing, it catches up on all of them in one forward. ``whole``: both
        caches allocate every position at first use (:class:`SlotKVCache`).
        """
        spans = self.target.attention.spans
        target_cache = SlotKVCache(num_slots, max_len, spans, max_forward, whole)
        return ModelPair(
            target=self.target,
            draft=self.draft,
            target_cache=target_cache,
            draft_cache=SlotKVCache(num_slots, max_len, whole=whole),
            vocab_size=self.vocab_size,
            log_top_m=self.log_top_m,
            controller=controller or self.controller,
            proposers=self.proposers,
        )

    def prepare(
        self, prompt: str | Sequence[int], options: RequestOptions | None = None, **keywords: Any
    ) -> DecodeRequest:
        """Validates one request; raises :class:`osd.errors.ParamError` naming the bad option
        (its ``param``).

        Args:
            prompt: text (needs a tokenizer) or token ids.
            options: the request's options (:class:`osd.decode.options.RequestOptions`, which
                documents each); None: the defaults.
            keywords: options over ``options``, by name (``max_tokens=64, temperature=0``),
                the Python API's way to give them.

        Returns:
            The request, ready for :class:`GenerationStream` or a batched engine's ``submit``.
        """
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size)  # the prompt's errors first
        options = RequestOptions.of(options, **keywords)
        auto_spec = options.num_spec_tokens == "auto"  # options.check() bounds a fixed k
        num_spec_tokens = self.max_spec_tokens if auto_spec else int(options.num_spec_tokens)
        params = options.sampling
        check_bias(params, self.vocab_size)
        self.draft.check_adapter(options.adapter)
        max_new = options.max_tokens
        if self.max_context is not None:
            max_new = fitted_budget(len(ids), max_new, self.max_context, options.fit_context)
        stop_token_ids = options.stop_token_ids
        if stop_token_ids is None:
            stop_token_ids = self.eos_token_ids
        if options.grammar is not None:  # a complete output ends with end-of-sequence
            stop_token_ids = (*stop_token_ids, self.grammars.eos_token_id)
        return DecodeRequest(
            options=options,
            prompt_ids=tuple(ids),
            seed=secrets.randbits(62) if options.seed is None else options.seed,
            max_new_tokens=max_new,
            num_spec_tokens=num_spec_tokens,
            # Greedy drafts would all be identical: one suffices.
            num_drafts=1 if params.is_greedy else options.num_drafts,
            adapter=options.adapter,
            stop_token_ids=frozenset(stop_token_ids),
            # Nothing generated is nothing to learn from (and a record holds >= 1 token).
            log_top_m=self.log_top_m if options.log and max_new > 0 else None,
            adaptive_threshold=self.adaptive_threshold,
            auto_spec=auto_spec,
        )


class GenerationStream:
    """One request decoded as a batch of one, step by step, in the iterating thread.

    Iterate for :class:`StreamChunk` s; once exhausted, :meth:`result` gives the whole
    :class:`GenerationResult` (with its log data). :meth:`cancel` stops after the current step
    and is safe from any thread. Runs the same batched step as a replica's decode loop.
    """

    def __init__(self, engine: SpeculativeDecoder, request: DecodeRequest) -> None:
        self.request = request
        self._row = Row(request, engine.tokenizer, slots=list(range(request.num_slots)))
        self._pair = engine.model_pair(
            request.num_slots, len(request.prompt_ids) + request.max_new_tokens
        )

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamChunk:
        row = self._row
        if row.done:
            raise StopIteration
        if row.prefill_left:
            chunks = prefill(self._pair, [row], row.prefill_left)
        else:
            chunks = run_step(self._pair, [row])
        _raise_failed([row])
        return chunks[0]

    @property
    def num_generated(self) -> int:
        """Tokens emitted so far."""
        return self._row.stats.num_generated

    def cancel(self) -> None:
        """Stops generating after the step in progress (e.g. the client went away); safe to
        call from any thread, also while another thread iterates."""
        self._row.cancelled.set()

    def result(self) -> GenerationResult:
        """The finished generation; drains the stream first if it is not exhausted."""
        for _ in self:
            pass
        return self._row.result()


def _raise_failed(rows: Sequence[Row]) -> None:
    """Raises what failed one of ``rows`` alone during a step (e.g. its grammar)."""
    for row in rows:
        if row.error is not None:
            raise row.error


def _shared_vocab_size(target: PreTrainedModel, draft: PreTrainedModel, tokenizer: Any) -> int:
    """The token ids the engine samples from: both heads score them and the tokenizer has them.

    Heads are often padded past the tokenizer (Qwen2.5-0.5B: 151,936 rows, 7B: 152,064, the
    tokenizer 151,665), and the padded rows of the two models may differ. Their logits are
    dropped before any softmax, as vLLM drops the rows it pads past ``org_vocab_size``: every
    distribution the engine samples, verifies and logs is the target's over the tokenizer's
    ids (the target's own, conditioned on a real token), so no method at any temperature can
    emit an id the tokenizer does not have (``docs/algorithms.md``, "Padded vocabularies").
    Without a tokenizer (token-id prompts), the heads must agree in size.
    """
    target_size = target.get_output_embeddings().weight.shape[0]
    draft_size = draft.get_output_embeddings().weight.shape[0]
    shared = min(target_size, draft_size)
    if tokenizer is not None and len(tokenizer) <= shared:
        return int(len(tokenizer))
    if target_size == draft_size:
        return int(target_size)
    raise ValueError(
        f"target and draft have different vocabularies ({target_size} vs {draft_size} tokens)"
        + ("" if tokenizer is None else f" and the tokenizer has {len(tokenizer)}")
    )


def end_of_sequence_ids(tokenizer: Any, model: Any, vocab_size: int) -> tuple[int, ...]:
    """The tokens that end a reply by default: the tokenizer's end-of-sequence and every one
    the model's generation config names (its ``eos_token_id``, an id or a list, as transformers'
    ``generate`` and vLLM stop on them). Instruction-tuned models end a turn with one of the
    latter: Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``, gpt-oss's ``<|call|>``, where
    the tokenizer's own is another."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    named = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += named if isinstance(named, list | tuple) else [named]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < vocab_size))
