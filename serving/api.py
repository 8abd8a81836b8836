"""The OpenAI-compatible HTTP API of a replica (FastAPI), independent of Ray.

``/v1/completions``, ``/v1/chat/completions`` (streaming over SSE with
``stream_options.include_usage``), ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``.
Every bad request gets an OpenAI-style 4xx body; nothing a client sends produces a 500 or a
hang. With ``serve.api_keys`` every ``/v1/*`` route wants ``Authorization: Bearer <key>``
(what OpenAI clients send): 401 otherwise, keys compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from osd.decode.generation import GenerationResult, TokenLogprob
from serving.logprobs import LogprobFormatter, echo_prefix
from serving.protocol import (
    MAX_JSON_DEPTH,
    APIError,
    ChatRequest,
    error_body,
    new_id,
    now,
    parse_request,
)
from serving.runtime import Job, ReplicaRuntime
from serving.tool_replies import ToolReply

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


def create_api(runtime: ReplicaRuntime) -> FastAPI:
    """Builds the FastAPI app serving ``runtime``."""
    app = FastAPI(title="osd", version="0.1.0")
    serve = runtime.config.serve
    authorized = [Depends(bearer_key_check(serve.api_keys))]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error: %s", exc)
        body = error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return JSONResponse(body, status_code=500)

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

    model = {"id": serve.model_name, "object": "model", "created": now(), "owned_by": "osd"}

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

    @app.post("/v1/completions", response_model=None, dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await _counted(runtime, "/v1/completions", _handle(runtime, request, "completion"))

    @app.post("/v1/chat/completions", response_model=None, dependencies=authorized)
    async def chat(request: Request) -> Response:
        return await _counted(runtime, "/v1/chat/completions", _handle(runtime, request, "chat"))

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
    runtime.check_model(request)  # before any grammar is compiled for it
    tools = runtime.tool_plan(request)
    job = runtime.admit(request, await runtime.grammar_of(request, tools), tools)
    if request.stream:
        return _JobStream(runtime, job, _sse(runtime, job, kind))
    results = await _unless_client_leaves(http, runtime.complete(job))
    if results is None:  # nobody reads the answer: its rows stopped at their next step
        return Response(status_code=499)
    logprobs = LogprobFormatter(runtime.engine.tokenizer, kind == "chat")
    echo = echo_prefix(request, job.stream.request.prompt_ids, runtime.engine.tokenizer)
    replies = _tool_replies(runtime, job)
    body = _response(job, kind, results, runtime.config.serve.model_name, logprobs, echo, replies)
    return JSONResponse(body)


async def _unless_client_leaves(
    http: Request, work: Coroutine[Any, Any, list[GenerationResult]]
) -> list[GenerationResult] | None:
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


def _tool_replies(runtime: ReplicaRuntime, job: Job) -> list[ToolReply | None]:
    """One reader of tool calls per choice (None each when the request offers no tools)."""
    if job.tools is None or runtime.tool_parser is None:
        return [None] * len(job.streams)
    return [ToolReply(runtime.tool_parser, job.tools) for _ in job.streams]


class _JobStream(StreamingResponse):
    """An event stream that gives its job back however the response ends.

    When the client disconnects, the server stops sending and drops the body generator, maybe
    before it ever ran (then no ``finally`` of it runs at all): without this, each such request
    kept its admission slot and adapter lease forever, and the replica ended up refusing
    everything with 429.
    """

    def __init__(self, runtime: ReplicaRuntime, job: Job, body: AsyncGenerator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._runtime, self._job, self._body = runtime, job, body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(RuntimeError):  # "already running": it ends by itself
                await self._body.aclose()  # never suspends: runs the stream's own clean-up
            self._runtime.abandon(self._job)


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
    job: Job,
    kind: str,
    results: list[GenerationResult],
    model: str,
    logprobs: LogprobFormatter,
    echo: tuple[str, list[int]] = ("", []),
    replies: list[ToolReply | None] | None = None,
) -> dict[str, Any]:
    replies = replies or [None] * len(results)
    return {
        "id": new_id("chatcmpl" if kind == "chat" else "cmpl"),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": now(),
        "model": model,
        "choices": [
            _choice(kind, i, result, logprobs, echo, replies[i]) for i, result in enumerate(results)
        ],
        "usage": _usage(job, results),
        "osd": _osd_stats(job, results),
    }


def _choice(
    kind: str,
    index: int,
    result: GenerationResult,
    logprobs: LogprobFormatter,
    echo: tuple[str, list[int]],
    reply: ToolReply | None = None,
) -> dict[str, Any]:
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish: str | None = result.finish_reason
        if reply is not None:
            message, finish = reply.message(result.text, finish)
        return {
            "index": index,
            "finish_reason": finish,
            "message": message,
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


async def _sse(runtime: ReplicaRuntime, job: Job, kind: str) -> AsyncGenerator[bytes]:
    chat = isinstance(job.request, ChatRequest)
    ident = new_id("chatcmpl" if chat else "cmpl")
    head = {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": runtime.config.serve.model_name,
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n".encode()

    formatter = LogprobFormatter(runtime.engine.tokenizer, chat)
    # Tokens whose text is held back (a possible stop string) send their logprobs with the
    # next event that has text, so every token's logprobs arrive, in order. With echo, the
    # prompt comes first, in the first event (as vLLM sends it). All of it per choice: events
    # carry their choice's index (OpenAI's n).
    num_choices = len(job.streams)
    prompt_ids = job.stream.request.prompt_ids
    echo_text, echo_ids = echo_prefix(job.request, prompt_ids, runtime.tokenizer)
    echo = [echo_text] * num_choices
    held_ids = [list(echo_ids) for _ in range(num_choices)]
    held: list[list[TokenLogprob | None] | None] = [None] * num_choices
    first = [True] * num_choices
    # Tool calls: a choice's text is read for them and what can go out goes out.
    replies = _tool_replies(runtime, job)

    def choice(
        index: int, text: str, finish: str | None, calls: list[dict[str, Any]]
    ) -> dict[str, Any]:
        logprobs = formatter.format(held_ids[index], held[index])
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first[index] else {}
            if text or not calls:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    # vLLM's continuous_usage_stats: each event says the tokens so far (all choices').
    generated, continuous = 0, job.request.continuous_usage

    def usage() -> dict[str, Any]:
        if not continuous:
            return {}
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
                text: str = chunk.text
                finish: str | None = chunk.finish_reason
                calls: list[dict[str, Any]] = []
                reply = replies[i]
                if reply is not None:
                    text, calls = reply.feed(text)
                    if finish is not None:
                        tail, last = reply.finish()
                        text, calls, finish = text + tail, calls + last, reply.finish_reason(finish)
                if text or calls or finish or first[i]:
                    yield event([choice(i, echo[i] + text, finish, calls)], **usage())
                    echo[i], first[i] = "", False
                    held_ids[i], held[i] = [], None if held[i] is None else []
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        logger.exception("stream failed after its first byte: %s", exc)
        yield f"data: {json.dumps(error_body(str(exc), kind='server_error'))}\n\n".encode()
        return
    results = job.results()  # every choice has ended: this does not block
    if job.request.include_usage:
        yield event([], usage=_usage(job, results), osd=_osd_stats(job, results))
    yield b"data: [DONE]\n\n"
