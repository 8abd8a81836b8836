"""The OpenAI-compatible HTTP API of a replica (FastAPI), independent of Ray.

``/v1/completions``, ``/v1/chat/completions`` (streaming over SSE with
``stream_options.include_usage``), ``/v1/models``, vLLM's ``/tokenize``, ``/detokenize`` and
``/version`` (:mod:`serving.tokenize_api`), ``/health``, ``/ready`` and ``/metrics``; CORS
for ``serve.cors_allowed_origins``. Every bad request gets an OpenAI-style 4xx body; nothing a
client sends produces a 500 or a hang. With ``serve.api_keys`` every ``/v1/*`` route (and
``/tokenize``, ``/detokenize``) wants ``Authorization: Bearer <key>`` (what OpenAI clients
send): 401 otherwise, keys compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import os
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from osd.decode.generation import GenerationResult, TokenLogprob
from osd.decode.grammar import GrammarFailed
from serving.chat_replies import ChatReply, Piece
from serving.logprobs import LogprobFormatter, echo_prefix
from serving.protocol import (
    MAX_JSON_DEPTH,
    APIError,
    ChatRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    parse_request,
)
from serving.responses_api import read_responses_request, response_events, responses_error
from serving.runtime import Job, ReplicaRuntime, grammar_failure
from serving.tokenize_api import detokenize, tokenize

__all__ = ["create_api"]

logger = logging.getLogger(__name__)


def bearer_key_check(keys: tuple[str, ...]) -> Any:
    """A FastAPI dependency that refuses a request without one of ``keys`` as its bearer
    token (none: every request passes)."""
    wanted = [key.encode() for key in keys]

    async def check(request: Request) -> None:
        if not wanted:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Every key compared, each in constant time: the time says nothing about which matched.
        matched = [hmac.compare_digest(given, key) for key in wanted]
        if not given or not any(matched):
            raise APIError(
                401,
                "missing or invalid API key: send Authorization: Bearer <key>",
                code="invalid_api_key",
            )

    return check


async def _cors_headers(policy: CORSMiddleware, request: Request) -> dict[str, str]:
    """The CORS headers ``policy`` puts on a response to ``request`` (its own rules, run on
    an empty response's start)."""
    start: dict[str, Any] = {"type": "http.response.start", "status": 500, "headers": []}

    async def kept(_: Any) -> None:
        return None

    await policy.send(start, kept, request.headers)
    return dict(MutableHeaders(scope=start))


def _installed_version() -> str:
    try:
        return importlib.metadata.version("osd")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


_VERSION = _installed_version()


def create_api(runtime: ReplicaRuntime) -> FastAPI:
    """Builds the FastAPI app serving ``runtime``."""
    app = FastAPI(title="osd", version=_VERSION)
    serve = runtime.config.serve
    authorized = [Depends(bearer_key_check(serve.api_keys))]
    cors: dict[str, Any] = {
        "allow_origins": list(serve.cors_allowed_origins),
        "allow_methods": ["*"],
        "allow_headers": ["*"],
    }
    cors_policy = None
    if serve.cors_allowed_origins:  # browsers' preflights and cross-origin calls (vLLM's)
        app.add_middleware(CORSMiddleware, **cors)
        cors_policy = CORSMiddleware(app, **cors)  # for a 500, answered outside the middleware

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(str(exc.detail))  # its headers kept: a 405's Allow
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette answers this outside every middleware, CORS's included: a browser would
        # see a network error instead of the 500's body, so its header is set here.
        logger.exception("internal error: %s", exc)
        body = error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        headers = None if cors_policy is None else await _cors_headers(cors_policy, request)
        return JSONResponse(body, status_code=500, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc.errors()[:1])), status_code=400)

    def loop() -> dict[str, Any]:
        if runtime.health is None:
            return {"status": "ok", "checks": {}, "problems": []}
        return runtime.health.report()  # the last probe's: answering costs nothing

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: 200 while the process answers. The body says whether the loop around
        the replica works (``status``: ok or degraded, with ``problems``), and, with a trainer
        pool, each worker's adapters and lag (``trainer_workers``)."""
        report = loop()
        body = {
            "status": report["status"],
            "problems": report["problems"],
            "pid": os.getpid(),
            "adapters": {a: runtime.slots.current(a) for a in runtime.slots.adapters},
            "adapter_events": list(runtime.adapter_events)[-20:],
        }
        workers = report.get("checks", {}).get("trainer", {}).get("workers")
        if workers:  # a trainer pool: who owns which adapter, how far behind
            body["trainer_workers"] = workers
        return body

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 while the replica can serve (a degraded loop costs records and
        adapter updates, never requests), 503 when its decode loop stopped. The body has
        every part of the loop (serving.health)."""
        serving = runtime.batch.alive
        body = {"ready": serving, **loop()}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics_text(), media_type="text/plain; version=0.0.4")

    model = {
        "id": serve.model_name,
        "object": "model",
        "created": now(),
        "owned_by": "osd",
        # vLLM's: what clients size their prompts by, and the model it serves.
        "root": runtime.config.model.target,
        "parent": None,
        "max_model_len": runtime.batch.max_len,
    }

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def one_model(model_id: str) -> dict[str, Any]:  # the client's models.retrieve
        if model_id != serve.model_name:
            raise APIError(
                404, f"model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        return model

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize_route(request: Request) -> dict[str, Any]:  # vLLM's
        return tokenize(runtime, await _read_json(request, serve.max_body_bytes))

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize_route(request: Request) -> dict[str, Any]:  # vLLM's
        return detokenize(runtime, await _read_json(request, serve.max_body_bytes))

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's
        return {"version": _VERSION}

    @app.post("/v1/completions", response_model=None, dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await _counted(runtime, "/v1/completions", _handle(runtime, request, "completion"))

    @app.post("/v1/chat/completions", response_model=None, dependencies=authorized)
    async def chat(request: Request) -> Response:
        return await _counted(runtime, "/v1/chat/completions", _handle(runtime, request, "chat"))

    @app.post("/v1/responses", response_model=None, dependencies=authorized)
    async def responses(request: Request) -> Response:
        return await _counted(runtime, "/v1/responses", _handle_responses(runtime, request))

    stored = "/v1/responses/{response_id:path}"

    @app.api_route(stored, methods=["GET", "POST", "DELETE"], dependencies=authorized)
    async def stored_response(response_id: str) -> Response:
        # Retrieve, delete, cancel, list input items: all of stored responses, which osd keeps
        # none of (every response says store: false).
        if response_id.strip("/") in ("", "input_tokens", "compact"):
            raise APIError(
                404,
                f"/v1/responses/{response_id} is not served by osd (it serves POST "
                "/v1/responses: the token count is the answer's usage.input_tokens)",
                code="not_found",
            )
        raise APIError(
            404,
            f"response {response_id.split('/')[0]!r} is not stored: osd stores no responses "
            "(every one answers store: false); send the conversation in input",
            param="response_id",
            code="response_not_found",
        )

    return app


async def _counted(
    runtime: ReplicaRuntime, endpoint: str, handling: Coroutine[Any, Any, Response]
) -> Response:
    """The handler's response, counted by its status in ``osd_requests_total`` (refusals by
    theirs; 499: the client left first)."""
    status = 500
    try:
        response = await handling
        status = response.status_code
        return response
    except APIError as exc:
        status = exc.status
        raise
    finally:
        runtime.metrics.requests.labels(endpoint, str(status)).inc()


async def _read_json(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body over {max_bytes} bytes", code="body_too_large")
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise APIError(413, f"request body over {max_bytes} bytes", code="body_too_large")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise APIError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels") from None


async def _handle(
    runtime: ReplicaRuntime, http: Request, kind: Literal["completion", "chat"]
) -> Response:
    data = await _read_json(http, runtime.config.serve.max_body_bytes)
    request = parse_request(kind, data)
    runtime.check_model(request.model)  # before any grammar is compiled for it
    jobs = await _admit_each_prompt(runtime, request)
    if request.stream:
        return _JobStream(runtime, jobs, _sse(runtime, jobs, kind))
    every = await _unless_client_leaves(http, _results_of(runtime, jobs))
    if every is None:  # nobody reads the answer: its rows stopped at their next step
        return Response(status_code=499)
    return JSONResponse(_response(runtime, jobs, kind, every))


async def _handle_responses(runtime: ReplicaRuntime, http: Request) -> Response:
    """OpenAI's Responses API, run as the chat request it reads into
    (:mod:`serving.responses_api`)."""
    asked = read_responses_request(await _read_json(http, runtime.config.serve.max_body_bytes))
    try:
        request = parse_request("chat", asked.chat)
        runtime.check_model(request.model)
        jobs = await _admit_each_prompt(runtime, request)
    except APIError as exc:
        raise responses_error(exc) from None
    if request.stream:
        return _JobStream(runtime, jobs, response_events(asked, _sse(runtime, jobs, "chat")))
    every = await _unless_client_leaves(http, _results_of(runtime, jobs))
    if every is None:
        return Response(status_code=499)
    [job], [[result]] = jobs, every
    [reply] = _replies(runtime, job)
    finish: str | None = result.finish_reason
    pieces = [Piece(content=result.text)]
    if reply is not None:  # in the order the reply said them
        pieces = reply.ordered(result.text, finish)
        finish = reply.finish_reason(finish)
    logprobs = LogprobFormatter(runtime.engine.tokenizer, True)
    return JSONResponse(
        asked.response(
            [piece.delta() for piece in pieces if piece.content or piece.thinking or piece.calls],
            finish,
            (logprobs.format(result.token_ids, result.logprobs) or {}).get("content"),
            _summed_usage(jobs, every),
            _prompts_stats(jobs, every),
        )
    )


async def _admit_each_prompt(
    runtime: ReplicaRuntime, request: CompletionRequest | ChatRequest
) -> list[Job]:
    """A job for each prompt of the request (a completion may list several, as OpenAI's and
    vLLM's do; a chat is one), each routed and logged on its own, admitted all or none: a
    refusal gives back those admitted before it. Choice i * n + j is prompt i's j-th."""
    count = len(request.prompts) if isinstance(request, CompletionRequest) else 1
    most = runtime.config.serve.max_ongoing_requests
    if count > most:  # each prompt takes one of the replica's places: never all at once
        raise APIError(
            400,
            f"prompt lists {count} prompts; this server takes at most {most} in one "
            "request (serve.max_ongoing_requests): send them in several requests",
            param="prompt",
        )
    prompts = request.each_prompt() if isinstance(request, CompletionRequest) else [request]
    jobs: list[Job] = []
    try:
        for one in prompts:
            tools = runtime.tool_plan(one)
            prompt = runtime.prompt_of(one, tools)  # rendered once for both
            grammar = await runtime.grammar_of(one, tools, prompt)
            jobs.append(runtime.admit(one, grammar, tools, prompt))
    except BaseException:
        for job in jobs:
            runtime.abandon(job)
        raise
    return jobs


async def _results_of(runtime: ReplicaRuntime, jobs: list[Job]) -> list[list[GenerationResult]]:
    """Every job's results, in the jobs' order (cancelled together; one that fails cancels
    the others, whose answers would never be read)."""
    waits = [asyncio.ensure_future(runtime.complete(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*waits))
    except BaseException:
        for wait in waits:
            wait.cancel()
            # Another that failed too is read here, not reported as never retrieved.
            wait.add_done_callback(lambda done: done.cancelled() or done.exception())
        raise


def _summed_usage(jobs: list[Job], every: list[list[GenerationResult]]) -> dict[str, Any]:
    """Every prompt's usage summed (each prompt counted once, every choice's completion)."""
    usages = [_usage(job, results) for job, results in zip(jobs, every, strict=True)]
    return {name: sum(usage[name] for usage in usages) for name in usages[0]}


def _prompts_stats(jobs: list[Job], every: list[list[GenerationResult]]) -> dict[str, Any]:
    """The first prompt's decoding statistics; with several prompts, every prompt's under
    ``prompts``."""
    each = [_osd_stats(job, results) for job, results in zip(jobs, every, strict=True)]
    return each[0] if len(each) == 1 else {**each[0], "prompts": each}


async def _unless_client_leaves(
    http: Request, work: Coroutine[Any, Any, list[list[GenerationResult]]]
) -> list[list[GenerationResult]] | None:
    """``work``'s results, or None once the client closed its connection first: then the work
    is cancelled (:meth:`ReplicaRuntime.complete` cancels its job). Without this a whole
    answer went on decoding for a client that had timed out (and whose library retried),
    holding its row and its admission slot; a stream notices at its next write."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_left(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _client_left(http: Request) -> None:
    """Returns when the server reports the client's connection closed (the body was read:
    nothing else comes before that)."""
    while (await http.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.01)  # a server that repeats other messages is not spun on


def _replies(runtime: ReplicaRuntime, job: Job) -> list[ChatReply | None]:
    """One reader of thinking and tool calls per choice (None each where the replica reads
    no thinking and the request offers no tools, or for completions)."""
    request = job.request
    if not isinstance(request, ChatRequest):
        return [None] * len(job.streams)
    tools = None if runtime.tool_format is None else job.tools
    if tools is None and runtime.reasoning_parser is None and not runtime.harmony:
        return [None] * len(job.streams)
    opened = runtime.prompt_opens_thinking(job)
    return [
        ChatReply(
            runtime.reasoning_reader(opened),
            runtime.tool_format,
            tools,
            request.include_reasoning,
            harmony=runtime.harmony,
        )
        for _ in job.streams
    ]


class _JobStream(StreamingResponse):
    """An event stream that gives its job back however the response ends.

    When the client disconnects, the server stops sending and drops the body generator, maybe
    before it ever ran (then no ``finally`` of it runs at all): without this, each such request
    kept its admission slot and adapter lease forever, and the replica ended up refusing
    everything with 429.
    """

    def __init__(
        self, runtime: ReplicaRuntime, jobs: list[Job], body: AsyncGenerator[bytes]
    ) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._runtime, self._jobs, self._body = runtime, jobs, body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with contextlib.suppress(RuntimeError):  # "already running": it ends by itself
                    await self._body.aclose()  # never suspends: runs the stream's own clean-up
            finally:
                for job in self._jobs:
                    self._runtime.abandon(job)


def _usage(job: Job, results: list[GenerationResult]) -> dict[str, Any]:
    """As OpenAI's: the prompt counted once, the completion tokens of every choice."""
    prompt_tokens = len(job.stream.request.prompt_ids)
    completion_tokens = sum(len(result.token_ids) for result in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _osd_stats(job: Job, results: list[GenerationResult]) -> dict[str, Any]:
    """The first choice's decoding statistics (with n > 1, every choice's under choices)."""
    stats: dict[str, Any] = {
        **results[0].stats.as_dict(),
        "adapter": job.lease.adapter,
        "adapter_version": job.lease.version,
        "method": job.stream.request.method,
        "proposers": results[0].stats.proposer_mix(),
        "route": job.route.reason,
        "note": job.route.note,
    }
    if len(results) > 1:
        stats["choices"] = [result.stats.as_dict() for result in results]
    return stats


def _response(
    runtime: ReplicaRuntime,
    jobs: list[Job],
    kind: str,
    every: list[list[GenerationResult]],
) -> dict[str, Any]:
    """A whole response: every job's choices, numbered on across the jobs."""
    tokenizer = runtime.engine.tokenizer
    choices: list[dict[str, Any]] = []
    for job, results in zip(jobs, every, strict=True):
        echo = echo_prefix(job.request, job.stream.request.prompt_ids, tokenizer)
        replies = _replies(runtime, job)
        first = len(choices)
        choices += [
            _choice(kind, first + j, result, tokenizer, echo, reply)
            for j, (result, reply) in enumerate(zip(results, replies, strict=True))
        ]
    return {
        "id": new_id("chatcmpl" if kind == "chat" else "cmpl"),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": now(),
        "model": runtime.config.serve.model_name,
        "choices": choices,
        "usage": _summed_usage(jobs, every),
        "osd": _prompts_stats(jobs, every),
    }


def _choice(
    kind: str,
    index: int,
    result: GenerationResult,
    tokenizer: Any,
    echo: tuple[str, list[int]],
    reply: ChatReply | None = None,
) -> dict[str, Any]:
    """One choice of a whole response; its logprobs' text offsets count from its own text."""
    logprobs = LogprobFormatter(tokenizer, kind == "chat")
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish: str | None = result.finish_reason
        if reply is not None:
            message, finish = reply.message(result.text, finish)
        return {
            "index": index,
            "finish_reason": finish,
            "message": {**message, "refusal": None},  # OpenAI's and vLLM's: nothing refused
            "logprobs": logprobs.format(result.token_ids, result.logprobs),
        }
    # echo: the prompt's text and tokens (with their logprobs) before the completion's.
    entries: list[TokenLogprob | None] | None = None
    if result.logprobs is not None:
        entries = [*result.logprobs]
    if echo[1] and entries is not None:
        entries = [*(result.prompt_logprobs or []), *entries]
    return {
        "index": index,
        "text": echo[0] + result.text,
        "finish_reason": result.finish_reason,
        "logprobs": logprobs.format(echo[1] + result.token_ids, entries),
    }


async def _sse(runtime: ReplicaRuntime, jobs: list[Job], kind: str) -> AsyncGenerator[bytes]:
    """The jobs' events as they come, in one stream (a second job's choices numbered on from
    the first's), then the usage summed and ``[DONE]``."""
    head = _stream_head(runtime, kind == "chat")
    failed: list[str] = []
    if len(jobs) == 1:  # no hand-off through a queue
        async for event in _job_events(runtime, jobs[0], head, 0, failed):
            yield event
    else:
        async for event in _merged_events(runtime, jobs, head, failed):
            yield event
    if failed:  # reported in-band: no usage, no [DONE]
        return
    every = [job.results() for job in jobs]  # every choice has ended: this does not block
    if jobs[0].request.include_usage:
        stats = _prompts_stats(jobs, every)
        yield _event(head, [], usage=_summed_usage(jobs, every), osd=stats)
    yield b"data: [DONE]\n\n"


async def _merged_events(
    runtime: ReplicaRuntime, jobs: list[Job], head: dict[str, Any], failed: list[str]
) -> AsyncGenerator[bytes]:
    """Several jobs' events (:func:`_job_events`) as each comes."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(job: Job, offset: int) -> None:
        try:
            async for event in _job_events(runtime, job, head, offset, failed):
                queue.put_nowait(event)
        finally:
            queue.put_nowait(None)

    offsets = [sum(len(job.streams) for job in jobs[:i]) for i in range(len(jobs))]
    pumps = [
        asyncio.ensure_future(pump(job, first)) for job, first in zip(jobs, offsets, strict=True)
    ]
    try:
        running = len(pumps)
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield event
    finally:
        # The client left: a running pump's stream cancels its job; one that never ran left
        # its job undelivered, for _JobStream to give back. Nothing here waits.
        for task in pumps:
            task.cancel()


def _stream_head(runtime: ReplicaRuntime, chat: bool) -> dict[str, Any]:
    """The fields every event of one stream repeats."""
    return {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": runtime.config.serve.model_name,
    }


def _event(head: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n".encode()


async def _job_events(
    runtime: ReplicaRuntime, job: Job, head: dict[str, Any], offset: int, failed: list[str]
) -> AsyncGenerator[bytes]:
    """One job's events, its choices numbered from ``offset``; a failure after the first
    byte is reported in-band and noted in ``failed``."""
    chat = isinstance(job.request, ChatRequest)
    # Tokens whose text is held back (a possible stop string) send their logprobs with the
    # next event that has text, so every token's logprobs arrive, in order. With echo, the
    # prompt comes first, in the first event (as vLLM sends it). All of it per choice: events
    # carry their choice's index (OpenAI's n).
    num_choices = len(job.streams)
    # Each choice's text offsets count from its own text.
    formatters = [LogprobFormatter(runtime.engine.tokenizer, chat) for _ in range(num_choices)]
    prompt_ids = job.stream.request.prompt_ids
    echo_text, echo_ids = echo_prefix(job.request, prompt_ids, runtime.tokenizer)
    echo = [echo_text] * num_choices
    held_ids = [list(echo_ids) for _ in range(num_choices)]
    held: list[list[TokenLogprob | None] | None] = [None] * num_choices
    first = [True] * num_choices
    # Thinking and tool calls: a choice's text is read for them and what can go out goes out.
    replies = _replies(runtime, job)

    def choice(index: int, piece: Piece, finish: str | None) -> dict[str, Any]:
        logprobs = formatters[index].format(held_ids[index], held[index])
        number = offset + index
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first[index] else {}
            delta.update(piece.delta())
            return {"index": number, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        text = echo[index] + piece.content
        return {"index": number, "text": text, "finish_reason": finish, "logprobs": logprobs}

    # vLLM's continuous_usage_stats: each event says the tokens so far (all choices'). Without
    # it, a stream that asked for usage says ``"usage": null`` until its last event, as
    # OpenAI's does.
    generated, continuous = 0, job.request.continuous_usage
    asked = job.request.include_usage

    def usage() -> dict[str, Any]:
        if not continuous:
            return {"usage": None} if asked else {}
        total = len(prompt_ids) + generated
        used = {"prompt_tokens": len(prompt_ids), "completion_tokens": generated}
        return {"usage": {**used, "total_tokens": total}}

    try:
        async with contextlib.aclosing(runtime.stream(job)) as chunks:
            async for i, chunk in chunks:
                generated += len(chunk.token_ids)
                held_ids[i] += chunk.token_ids
                if chunk.logprobs is not None:
                    # The prompt's (echo's) come with the first chunk only.
                    held[i] = [*(held[i] or []), *(chunk.prompt_logprobs or []), *chunk.logprobs]
                finish: str | None = chunk.finish_reason
                reply = replies[i]
                if reply is None:
                    pieces = [Piece(content=chunk.text)]
                else:  # (text after a call in this chunk: an event after the call's)
                    pieces = reply.feed_ordered(chunk.text)
                    if finish is not None:
                        pieces[-1] += reply.finish(finish)
                        finish = reply.finish_reason(finish)
                for j, piece in enumerate(pieces):
                    last = j == len(pieces) - 1
                    end = finish if last else None
                    if piece.content or piece.thinking or piece.calls or end or (first[i] and last):
                        yield _event(head, [choice(i, piece, end)], **usage())
                        echo[i], first[i] = "", False
                        held_ids[i], held[i] = [], None if held[i] is None else []
    except GrammarFailed as exc:  # the request's grammar, not the server: its 400, in-band
        failed.append(str(exc))
        yield f"data: {json.dumps(grammar_failure(job, exc).body())}\n\n".encode()
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        logger.exception("stream failed after its first byte: %s", exc)
        failed.append(str(exc))
        yield f"data: {json.dumps(error_body(str(exc), kind='server_error'))}\n\n".encode()
