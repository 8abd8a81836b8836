"""One replica's state: the engine, the draft's adapter versions, router, log writer, metrics.

All requests of a replica are decoded by one batched loop (:class:`osd.decode.loop.
BatchedEngine`): each is a row with its own KV slot, random streams and leased adapter
version, and every step drafts, verifies and emits for all rows together. The rows hand their
outputs to the event loop from the decoding thread (:mod:`serving.jobs`); no thread waits on
them. After a request, its record goes to the log
writer's queue (never blocking) unless it opted out. A request for ``n`` choices is a group of
``n`` rows sharing one prefill (:mod:`osd.decode.choices`); each choice's record is logged on its
own, under the request's id (so the trainer holds all choices of a prompt out, or none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from osd.buffer.record import Record
from osd.config import OSDConfig
from osd.decode.choices import choice_requests
from osd.decode.engine import SpeculativeDecoder
from osd.decode.generation import GenerationResult, StreamChunk
from osd.decode.grammar import Grammar, GrammarFailed
from osd.decode.loop import BatchedEngine, EngineFull
from osd.decode.models import special_token_ids
from osd.decode.request import DecodeRequest
from osd.errors import ParamError
from osd.threads import single_threaded_torch
from osd.versions.errors import BASE_VERSION
from serving.adapter_slots import AdapterLease, AdapterSlots
from serving.jobs import Job
from serving.live_monitor import LiveMonitor
from serving.metrics import ReplicaMetrics
from serving.protocol import APIError, ChatRequest, CompletionRequest
from serving.reasoning import MARKERS as REASONING_MARKERS
from serving.reasoning import ReasoningReader, detect_reasoning, prompt_opens_thinking
from serving.router import ROUTER_MONITOR_KEY, AdapterRouter
from serving.structured_output import grammar_ask
from serving.tool_parsers import GEMMA_TOOL_RESPONSE, PARSERS, detect_parser, tool_call_format
from serving.tools import ToolPlan, plan_tools, template_messages

__all__ = ["Job", "ReplicaRuntime"]

# The longest the events budget (serve.stream_events_per_s) makes a stream gather over.
_MAX_BUDGET_INTERVAL = 0.2

logger = logging.getLogger(__name__)


class ReplicaRuntime:
    """Everything a replica needs to serve; independent of Ray and HTTP (tested without)."""

    def __init__(
        self,
        config: OSDConfig,
        engine: SpeculativeDecoder,
        batch: BatchedEngine,
        slots: AdapterSlots,
        router: AdapterRouter,
        metrics: ReplicaMetrics,
        *,
        log_writer: Any = None,
        monitor: LiveMonitor | None = None,
        events: deque[dict[str, Any]] | None = None,
        health: Any = None,
    ) -> None:
        """The replica's parts, built and wired by :mod:`serving.replica`: the engine and the
        batched loop that decodes with it, the draft's adapter slots, the router, metrics, the
        log writer (None: no logging), the live monitor the watcher rolls back by (None: no
        watcher), the recent adapter events the watcher appends to, and the loop health probe
        (``serving.health.LoopHealth``; None: report ok)."""
        self.config, self.engine, self.batch = config, engine, batch
        self.slots, self.router, self.metrics = slots, router, metrics
        self.log_writer, self.monitor, self.health = log_writer, monitor, health
        self.adapter_events = events if events is not None else deque(maxlen=100)
        self._admission = threading.BoundedSemaphore(config.serve.max_ongoing_requests)
        # Unloads adapter versions a finished request was the last to use, off the event loop.
        self._housekeeping = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="adapters", initializer=single_threaded_torch
        )
        # Structured-output grammars compile here, one at a time: a flood of new schemas queues
        # instead of taking the cores from the decode loop.
        self._compiles = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammars")
        parser = config.serve.tool_call_parser
        template = getattr(engine.tokenizer, "chat_template", None)
        # How replies are read for tool calls (None: tools are refused), and written.
        self.tool_parser = detect_parser(template) if parser == "auto" else parser
        if self.tool_parser == "none":
            self.tool_parser = None
        self.tool_format = (
            None
            if self.tool_parser is None
            else tool_call_format(self.tool_parser, template, engine.tokenizer)
        )
        # How chat replies' thinking is read apart from their answer (None: it is not).
        reasoning = config.serve.reasoning_parser
        self.reasoning_parser = detect_reasoning(template) if reasoning == "auto" else reasoning
        if self.reasoning_parser == "none":
            self.reasoning_parser = None
        # gpt-oss's harmony: a chat reply's markers are read for thinking, content and calls;
        # a reply ends at <|return|> and at <|call|> (some generation configs name only one).
        self.harmony = self.tool_parser == "openai" or self.reasoning_parser == "openai_gptoss"
        # The markers a chat reply is read by are special tokens (harmony's; GLM's </think>):
        # chat replies keep special tokens in their text, as vLLM asks of such parsers.
        special = special_token_ids(engine.tokenizer)
        self._reads_special = self.harmony or (
            self.reasoning_parser in REASONING_MARKERS
            and REASONING_MARKERS[self.reasoning_parser][1] in special
        )
        # A reply ends where the model hands over to what its template writes next: harmony's
        # <|return|> and <|call|>; Gemma 4's <|tool_response>, after its calls.
        ends: tuple[str, ...] = ("<|return|>", "<|call|>") if self.harmony else ()
        if self.tool_parser == "gemma4":
            ends = (GEMMA_TOOL_RESPONSE,)
        known = (special[m] for m in ends if m in special)
        engine.eos_token_ids = (
            *engine.eos_token_ids,
            *(i for i in known if i not in engine.eos_token_ids),
        )
        self._streaming = 0  # streamed jobs not ended yet (the stream interval's budget)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def prompt_opens_thinking(self, job: Job) -> bool:
        """Whether the job's prompt leaves the model inside ``<think>`` (its template opened
        it), read from the prompt's last tokens; where a grammar writes the reply, whether it
        was compiled ``thinking_first`` (else its text is all answer)."""
        grammar = job.stream.request.grammar
        if grammar is not None:  # compiled thinking first exactly where the prompt opened it
            return grammar.thinks
        tail = self.tokenizer.decode(job.stream.request.prompt_ids[-8:])
        return prompt_opens_thinking(tail, self.reasoning_parser or "qwen3")

    def _thinks_first(
        self,
        request: CompletionRequest | ChatRequest,
        tools: ToolPlan | None,
        field: str,
        prompt: str | list[int] | None,
    ) -> bool:
        """Whether a chat request's grammar (asked by ``field``) should hold only after the
        model's thinking: its prompt opens ``<think>`` (or the parser is deepseek_r1's, whose
        models think first), or, with harmony, structured output (in the final channel, after
        an analysis; a forced call's grammar writes harmony's own commentary message)."""
        if self.harmony:
            return isinstance(request, ChatRequest) and field != "tools"
        if not isinstance(request, ChatRequest) or self.reasoning_parser not in (
            "qwen3",
            "deepseek_r1",
        ):
            return False
        if self.reasoning_parser == "deepseek_r1":
            return True
        if prompt is None:
            prompt = self.prompt_of(request, tools)
        return isinstance(prompt, str) and prompt_opens_thinking(prompt[-64:])

    def reasoning_reader(self, opened: bool) -> ReasoningReader | None:
        """A reader of one reply's thinking (None: the replica reads none, or reads harmony)."""
        if self.reasoning_parser is None or self.harmony:
            return None
        return ReasoningReader(self.reasoning_parser, opened)

    def tool_plan(self, request: CompletionRequest | ChatRequest) -> ToolPlan | None:
        """What the request's tool fields ask (None: no tools), or a 400 saying why not."""
        if not isinstance(request, ChatRequest):
            return None
        try:
            plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
        except ParamError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        if plan is not None and self.tool_parser is None:
            raise APIError(
                400,
                "tools: this server reads no tool calls for its model (its chat template shows "
                "no known tool-call format); start it with serve.tool_call_parser set to "
                f"one of {', '.join(PARSERS)} where the model writes one of those",
                param="tools",
                code="unsupported_parameter",
            )
        return plan

    def prompt_of(
        self, request: CompletionRequest | ChatRequest, tools: ToolPlan | None = None
    ) -> str | list[int]:
        if isinstance(request, CompletionRequest):
            return request.prompt  # type: ignore[return-value]
        try:
            messages = template_messages(request.messages)
        except ParamError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        if self.tool_format is not None:
            messages = self.tool_format.template_messages(messages)
        tokenizer = self.tokenizer
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return _render(tokenizer, messages, tools, _template_variables(tokenizer, request))
        if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise APIError(
                400,
                "tools: the model has no chat template to show them to it; start the server "
                "with model.chat_template",
                param="tools",
                code="unsupported_parameter",
            )
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def check_model(self, model: str) -> None:
        """Raises the 404 of a request for a ``model`` this replica does not serve."""
        name = self.config.serve.model_name
        if model != name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )

    async def grammar_of(
        self,
        request: CompletionRequest | ChatRequest,
        tools: ToolPlan | None = None,
        prompt: str | list[int] | None = None,
    ) -> Grammar | None:
        """The grammar the request asks for (structured output, or the tool calls that
        ``tool_choice`` requires), compiled off the event loop (a large schema takes up to
        about a second; repeated ones are cached); None: none. ``prompt``: the request's, as
        :meth:`prompt_of` renders it (rendered here where not given).

        Raises:
            APIError: 400 naming the field whose grammar does not compile, or two asks.
        """
        try:
            ask = grammar_ask(request)
        except ParamError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        if tools is not None and tools.forced:
            if ask is not None:
                raise APIError(
                    400,
                    f"tool_choice asks for tool calls and {ask[0]} for structured output; "
                    "ask for one of them",
                    param="tool_choice",
                )
            assert self.tool_format is not None  # tool_plan refused tools without a parser
            try:
                source = self.tool_format.grammar(tools.forced, tools.parallel)
            except ValueError as exc:
                raise APIError(400, f"tools: {exc}", param="tools") from None
            ask = ("tools", "lark", source)
        if ask is None:
            return None
        field, kind, spec = ask
        # A client's Lark grammar that names special tokens by id writes the reply's own
        # format: the whole reply.
        raw = field != "tools" and kind == "lark" and isinstance(spec, str) and "<[" in spec
        thinks_first = not raw and self._thinks_first(request, tools, field, prompt)
        compile_it = functools.partial(self.engine.grammars.compile, kind, spec, thinks_first)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._compiles, compile_it)
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", param=field) from None

    def admit(
        self,
        request: CompletionRequest | ChatRequest,
        grammar: Grammar | None = None,
        tools: ToolPlan | None = None,
        prompt: str | list[int] | None = None,
    ) -> Job:
        """Validates and starts a request, or raises :class:`APIError` (4xx) at once
        (``prompt``: as :meth:`grammar_of` takes it)."""
        serve = self.config.serve
        self.check_model(request.model)
        max_tokens = request.requested_tokens(serve.max_tokens_limit)
        # The budget's field as the request spells it.
        budget = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        if max_tokens > serve.max_tokens_limit:
            raise APIError(
                400,
                f"{budget} is {max_tokens}; this server allows at most {serve.max_tokens_limit}",
                param=budget,
            )
        if not self._admission.acquire(blocking=False):
            raise APIError(
                429,
                "too many requests in flight on this replica; retry shortly",
                kind="rate_limit_error",
                code="overloaded",
            )
        try:
            prepared = self._prepare(request, grammar, tools, prompt)
            route = self.router.choose(request.draft, request.domain, prepared.prompt_ids)
            if route.reason == "fallback":
                self.metrics.router_fallbacks.inc()
            lease = self.slots.acquire(route.adapter)
            try:
                prepared = dataclasses.replace(
                    prepared, adapter=lease.peft_name, base_weights=lease.version == BASE_VERSION
                )
                streams = self.batch.submit_group(choice_requests(prepared, request.n))
            except EngineFull as exc:
                self._give_back(lease)
                raise APIError(429, str(exc), kind="rate_limit_error", code="overloaded") from None
            except BaseException:
                self._give_back(lease)
                raise
        except ValueError as exc:
            self._admission.release()
            param = getattr(exc, "param", None)
            if param == "prompt" and isinstance(request, ChatRequest):
                param = "messages"  # a chat's prompt is its messages
            elif param == "max_tokens":
                param = budget
            raise APIError(400, str(exc), param=param) from None
        except BaseException:
            self._admission.release()
            raise
        self.metrics.in_flight.inc()
        return Job(request, streams, route, lease, on_finish=self._finish, tools=tools)

    def _prepare(
        self,
        request: CompletionRequest | ChatRequest,
        grammar: Grammar | None,
        tools: ToolPlan | None,
        prompt: str | list[int] | None,
    ) -> DecodeRequest:
        """The request, checked and tokenized; its adapter is set once the router chose it."""
        options = request.options(
            self.config.spec,
            self.config.serve.max_tokens_limit,
            stop_token_ids=self._stop_token_ids(request.stop_token_ids, request.ignore_eos),
            log=self.log_writer is not None and request.log,
            grammar=grammar,
        )
        special = (
            tools is not None and self.tool_format is not None and self.tool_format.special_text
        )
        if special or (self._reads_special and isinstance(request, ChatRequest)):
            # The markers are special tokens: the parser reads them in the text.
            options = dataclasses.replace(options, skip_special_tokens=False)
        if prompt is None:
            prompt = self.prompt_of(request, tools)
        return self.engine.prepare(prompt, options)

    def _stop_token_ids(self, extra: list[int], ignore_eos: bool) -> list[int] | None:
        """The tokens that end the request: its stop token ids and, unless it ignores it,
        end-of-sequence (the tokenizer's and the model's generation config's); None: the
        engine's default (end-of-sequence alone)."""
        if ignore_eos:
            return list(extra)
        if not extra:
            return None
        return [*extra, *self.engine.eos_token_ids]

    async def complete(self, job: Job) -> list[GenerationResult]:
        """Waits for a request's end; one result per choice. Cancelled (the client went
        away), it stops decoding; the job ends itself when its rows are gone."""
        done = job.deliver(stream=False)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            job.cancel()
            raise
        except GrammarFailed as exc:
            raise grammar_failure(job, exc) from None

    def stream(self, job: Job) -> AsyncGenerator[tuple[int, StreamChunk]]:
        """Yields (choice index, chunk) as the rows verify them; cancels the job if the
        consumer stops (:meth:`serving.jobs.Job.chunks`)."""
        job.deliver(stream=True, interval=self.stream_interval)
        self._streaming += 1
        return job.chunks()

    def stream_interval(self) -> float:
        """Seconds a streamed choice gathers its steps over: ``serve.stream_interval_ms``, or
        longer where the open streams would send more than ``serve.stream_events_per_s``
        events together (each costs the replica's event loop, beside the decode thread)."""
        serve = self.config.serve
        budget = self._streaming / serve.stream_events_per_s if serve.stream_events_per_s else 0.0
        return max(serve.stream_interval_ms / 1000, min(budget, _MAX_BUDGET_INTERVAL))

    def abandon(self, job: Job) -> None:
        """Gives back a job whose response ended before its rows delivered (the client went
        away first); one that delivers ends itself."""
        job.give_back()

    def _finish(self, job: Job, results: list[GenerationResult] | None) -> None:
        """Metrics, router feedback, live monitor and the log record, off the decode path;
        the job calls it once, on the event loop."""
        try:
            if results is not None:
                self._account(job, results)
        finally:
            self._admission.release()
            self.metrics.in_flight.dec()
            self._streaming -= job.streamed
            self._give_back(job.lease)

    def _give_back(self, lease: AdapterLease) -> None:
        """Ends a lease; a version it was the last to use is unloaded off the event loop
        (unloading waits for the forwards in progress)."""
        if self.slots.release(lease):
            with contextlib.suppress(RuntimeError):  # the replica is closing: nothing to free
                self._housekeeping.submit(self.slots.collect)

    def _account(self, job: Job, results: list[GenerationResult]) -> None:
        self.metrics.observe_latency(
            time.perf_counter() - job.started,
            None if job.first_token_at is None else job.first_token_at - job.started,
        )
        for index, result in enumerate(results):  # each choice is a generation of its own
            self._account_choice(job, result, first=index == 0)

    def _account_choice(self, job: Job, result: GenerationResult, first: bool) -> None:
        """One choice's counts and record; ``first``: the prompt's tokens count with it (the
        choices of one request share one prefill)."""
        stats, lease, domain = result.stats, job.lease, job.request.domain or ""
        if stats.num_generated > 1 and job.first_token_at is not None:
            self.metrics.observe_itl(
                (time.perf_counter() - job.first_token_at) / (stats.num_generated - 1)
            )
        log = result.log
        # From the stats, not the log: a request that opted out of logging still counts.
        self.metrics.observe_generation(
            lease.adapter,
            lease.version,
            domain,
            stats.num_generated,
            stats.draft_lengths,
            stats.accepted_lengths,
            stats.by_proposer,
            prompt_tokens=len(job.streams[0].request.prompt_ids) if first else 0,
            finish_reason=result.finish_reason,
        )
        # The adapter is judged by the tokens it drafted, not by looked-up ones.
        _, drafted, accepted = stats.by_proposer.get("draft", (0, 0, 0))
        if drafted:
            self.router.record(job.route.route_key, lease.adapter, accepted / drafted)
            if self.monitor is not None:
                self.monitor.observe(lease.adapter, lease.version, accepted, drafted)
                if job.route.router_version is not None:  # judges the routing model's versions
                    self.monitor.observe(
                        ROUTER_MONITOR_KEY, job.route.router_version, accepted, drafted
                    )
        if self.log_writer is None:
            return
        if not job.request.log or log is None:
            self.log_writer.log(None, opt_out=True)
            return
        # Records name the logical adapter ("code"), not the loaded version ("code@3").
        self.log_writer.log(
            Record.from_generation(
                log,
                request_id=job.request_id,
                domain=domain,
                adapter_name=lease.adapter,
                adapter_version=lease.version,
            )
        )

    def metrics_text(self) -> bytes:
        """Prometheus exposition, with the log writer's and decode loop's counters read at
        scrape time."""
        loop = self.batch.stats
        self.metrics.observe_batch(loop.running, loop.waiting, loop.mean_batch, loop.steps)
        self.metrics.observe_prefix_cache(loop.prompt_tokens, loop.reused_tokens)
        if self.log_writer is not None:
            self.metrics.observe_writer(self.log_writer.metrics())
        return self.metrics.export()

    def close(self) -> None:
        self.batch.close()
        self._housekeeping.shutdown(wait=False)
        self._compiles.shutdown(wait=False, cancel_futures=True)
        if self.log_writer is not None:
            self.log_writer.close()


def grammar_failure(job: Job, exc: GrammarFailed) -> APIError:
    """The 400 of a request whose grammar gave up while it decoded (text the model's vocabulary
    cannot write, or a limit of the grammar engine), naming the field that asked for it: the
    request, not the server, is what cannot be served. Logged too: the parser's reason is the
    operator's to see if a grammar the model should follow fails."""
    logger.warning("request %s: %s", job.request_id, exc)
    forced = job.tools is not None and job.tools.forced
    ask = None if forced else grammar_ask(job.request)
    field = "tool_choice" if ask is None else ask[0]
    return APIError(400, f"{field}: {exc}", param=field)


def _template_variables(tokenizer: Any, request: ChatRequest) -> dict[str, Any]:
    """The chat template's variables a request sets: its ``chat_template_kwargs`` and its
    ``reasoning_effort`` (where the template takes one; else a 400, unless "none")."""
    variables = dict(request.chat_template_kwargs or {})
    effort = request.reasoning_effort
    if effort is None or "reasoning_effort" in variables:
        return variables
    if "reasoning_effort" in (getattr(tokenizer, "chat_template", None) or ""):
        variables["reasoning_effort"] = effort
    elif effort != "none":
        raise APIError(
            400,
            f"reasoning_effort is not supported by this model: its chat template takes no "
            f"reasoning effort (got {effort!r}); leave it out or send none",
            param="reasoning_effort",
            code="unsupported_parameter",
        )
    return variables


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: ToolPlan | None,
    variables: dict[str, Any],
) -> str:
    """The chat prompt by the model's template, with the plan's tools and the request's
    ``chat_template_kwargs``.

    Raises:
        APIError: 400 when the template refuses the messages or leaves the tools out.
    """
    from jinja2 import TemplateError

    offered = None if tools is None else tools.tools
    try:
        rendered = str(
            tokenizer.apply_chat_template(
                messages, tools=offered, add_generation_prompt=True, tokenize=False, **variables
            )
        )
    except TemplateError as exc:  # a template that refuses a role or an order
        raise APIError(
            400, f"messages: the model's chat template refused them: {exc}", param="messages"
        ) from None
    if tools is not None and not all(name in rendered for name in tools.names):
        raise APIError(
            400,
            "tools: the model's chat template does not show tools to the model; start the "
            "server with a model.chat_template that renders them",
            param="tools",
            code="unsupported_parameter",
        )
    return rendered
