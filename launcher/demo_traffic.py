"""``osd demo``'s traffic: the client threads that send the workload through the HTTP API.

Completions go to ``/v1/completions`` with httpx; chats (items with ``messages``) go to
``/v1/chat/completions`` through the official ``openai`` client, their domain and speculation
settings in the request's extra body (with ``labels=False`` no request carries a domain: the
replica routes by the prompt's content), the osd stats read from the response's extra field ``osd``.
A window of ``concurrency`` consecutive items in every ``reference_every`` is sent with
speculation off: the target-only reference. Every finished request is kept as a :class:`Sample`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Sample", "TrafficDriver", "is_reference"]


@dataclass
class Sample:
    """One finished request as the client saw it."""

    time: float  # seconds since the traffic started
    domain: str
    phase: str
    acceptance: float
    tokens: int
    latency: float
    adapter: str
    version: int
    status: int
    drafted: int = 0  # drafted tokens (0: no measurement of acceptance)
    mean_k: float = 0.0  # tokens drafted per step, as the goodput controller chose them
    reference: bool = False  # sent with speculation off: the target-only reference
    decode_seconds: float = 0.0  # the replica's time from the first token to the last
    endpoint: str = "completions"  # or "chat": /v1/chat/completions (then domain is "chat")
    topic: str = ""  # the request's own domain, its route key (differs from domain for chats)
    text_chars: int = 0  # characters of the returned text (a chat answering "" shows here)
    tools_offered: int = 0  # tools the chat offered (sent with tool_choice "auto")
    tool_calls: int = 0  # the tool calls it answered with
    # Who drafted (the response's osd.proposers): proposer -> steps, drafted, accepted.
    proposers: dict[str, dict[str, int]] = field(default_factory=dict)


def is_reference(index: int, concurrency: int, every: int) -> bool:
    """Whether workload item ``index`` is sent with speculation off (0: never).

    Windows of ``concurrency`` consecutive items, one window in ``every``: the clients take
    items in order, so the requests of a window mostly run beside each other, and the replica
    serves them as a replica with speculation off would.
    """
    return every > 0 and (index // max(concurrency, 1)) % every == every - 1


class TrafficDriver:
    """Sends workload items in order from a few client threads; keeps every sample."""

    def __init__(
        self,
        base_url: str,
        items: list[Any],
        model: str,
        concurrency: int,
        reference_every: int = 10,
        api_key: str | None = None,
        *,
        labels: bool = True,
    ) -> None:
        self.base_url = base_url
        self.labels = labels  # False: no "domain" in the requests (the replica routes by content)
        self.url = f"{base_url}/v1/completions"
        self.api_key = api_key
        self.items, self.model, self.concurrency = items, model, concurrency
        self.reference_every = reference_every
        self.samples: list[Sample] = []
        self.failures = 0
        self.errors: list[str] = []  # the first few failures, for the report
        self.start_time = time.monotonic()
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, daemon=True) for _ in range(concurrency)
        ]

    def start(self) -> None:
        self.start_time = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def _take(self) -> tuple[int, Any] | None:
        with self._lock:
            if self._next >= len(self.items) or self._stop.is_set():
                return None
            self._next += 1
            return self._next - 1, self.items[self._next - 1]

    def _worker(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        chat: Any = None  # the openai client, made on this thread's first chat
        with httpx.Client(timeout=300, headers=headers) as client:
            try:
                while (taken := self._take()) is not None:
                    index, item = taken
                    reference = is_reference(index, self.concurrency, self.reference_every)
                    if getattr(item, "messages", None) is None:
                        self._send(client, item, reference)
                        continue
                    if chat is None:
                        import openai

                        # No retries: a failure is counted, as on the completions path.
                        chat = openai.OpenAI(
                            base_url=f"{self.base_url}/v1",
                            api_key=self.api_key or "unused",
                            max_retries=0,
                            timeout=300,
                        )
                    self._send_chat(chat, item, reference)
            finally:
                if chat is not None:
                    chat.close()

    def _send_chat(self, client: Any, item: Any, reference: bool) -> None:
        """One chat through the official client; the osd stats are the response's extra
        field ``osd``, the domain and speculation settings go in the request's extra body."""
        import openai

        extra: dict[str, Any] = {"domain": item.domain} if self.labels else {}
        if reference:
            extra["spec"] = {"method": "none"}
        options: dict[str, Any] = {} if item.seed is None else {"seed": item.seed}
        if getattr(item, "tools", None):
            options["tools"] = item.tools
        start = time.monotonic()
        try:
            completion = client.chat.completions.create(
                model=self.model,
                messages=item.messages,
                max_completion_tokens=item.max_tokens,
                temperature=0.0 if item.temperature is None else item.temperature,
                extra_body=extra,
                **options,
            )
        except openai.APIStatusError as e:
            self._failed(f"chat request {item.id}: HTTP {e.status_code}: {str(e)[:300]}")
            return
        except openai.APIError as e:
            self._failed(f"chat request {item.id}: {type(e).__name__}: {e}")
            return
        stats = (completion.model_extra or {}).get("osd")
        if not isinstance(stats, dict) or completion.usage is None:
            self._failed(f"chat request {item.id}: no osd stats or usage in the response")
            return
        message = completion.choices[0].message
        calls = message.tool_calls or []
        # A reply that only calls tools has no content: the calls are its text.
        text = (message.content or "") + "".join(
            c.function.name + c.function.arguments for c in calls if c.type == "function"
        )
        self._record(
            item,
            stats,
            completion.usage.completion_tokens,
            text,
            start,
            reference,
            "chat",
            tool_calls=len(calls),
        )

    def _record(
        self,
        item: Any,
        stats: dict[str, Any],
        tokens: int,
        text: str,
        start: float,
        reference: bool,
        endpoint: str,
        tool_calls: int = 0,
    ) -> None:
        sample = Sample(
            time=time.monotonic() - self.start_time,
            domain="chat" if endpoint == "chat" else item.domain,
            phase=item.phase or item.domain,
            acceptance=stats["acceptance_rate"],
            tokens=tokens,
            latency=time.monotonic() - start,
            adapter=stats["adapter"],
            version=stats["adapter_version"],
            status=200,
            drafted=stats["drafted"],
            mean_k=stats["mean_draft_length"],
            decode_seconds=stats["decode_seconds"],
            reference=reference,
            endpoint=endpoint,
            topic=item.domain,
            text_chars=len(text),
            tools_offered=len(getattr(item, "tools", None) or []),
            tool_calls=tool_calls,
            proposers=dict(stats.get("proposers") or {}),
        )
        with self._lock:
            self.samples.append(sample)

    def _send(self, client: httpx.Client, item: Any, reference: bool) -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": item.prompt,
            "max_tokens": item.max_tokens,
            "temperature": 0.0 if item.temperature is None else item.temperature,
        }
        if self.labels:
            body["domain"] = item.domain
        if item.seed is not None:
            body["seed"] = item.seed
        if reference:
            body["spec"] = {"method": "none"}
        start = time.monotonic()
        try:
            response = client.post(self.url, json=body)
            data = response.json()
        except (httpx.HTTPError, ValueError) as e:
            self._failed(f"request {item.id}: {type(e).__name__}: {e}")
            return
        if response.status_code != 200:
            self._failed(f"request {item.id}: HTTP {response.status_code}: {response.text[:300]}")
            return
        text = data["choices"][0]["text"]
        tokens = data["usage"]["completion_tokens"]
        self._record(item, data["osd"], tokens, text, start, reference, "completions")

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            if len(self.errors) < 20:
                self.errors.append(reason)
