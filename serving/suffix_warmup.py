"""A new or restarted replica's suffix store, warmed from the newest records of the log stream.

Records already carry every token id of their requests (never text), so the replica reads the
newest ``spec.suffix_warm_records`` of them with ``XREVRANGE``, a page at a time, without
joining the trainer's consumer group (nothing is acknowledged or claimed), and hands their
prompts and outputs to the ``suffix`` proposer in one step (:meth:`Proposers.warm`). It runs in
a thread of its own beside the decode loop: a Redis that is down or slow costs the warm start,
never a request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from osd.buffer.record import Record
from osd.buffer.redis_server import connect, redact_url
from osd.decode.proposers import Proposers

__all__ = ["SuffixWarmup"]

log = logging.getLogger(__name__)

_PAGE = 100  # records per XREVRANGE call (a record of 256 tokens with m = 32 is ~50 KB)


@dataclass
class SuffixWarmup:
    """Reads up to ``max_records`` of the newest records of ``stream`` at ``url`` into
    ``proposers`` in a daemon thread (:meth:`start`); :attr:`done` is set when it is over."""

    proposers: Proposers
    url: str
    stream: str
    max_records: int
    records: int = 0
    tokens: int = 0
    seconds: float = 0.0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> SuffixWarmup:
        threading.Thread(target=self._run, name="osd-suffix-warmup", daemon=True).start()
        return self

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            documents = self._read()
            self.proposers.warm(documents)
            self.records = len(documents)
            self.tokens = sum(len(tokens) for tokens, _ in documents)
        except (redis.RedisError, OSError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("suffix warm start from %s skipped: %s", redact_url(self.url), self.error)
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()
        if not self.error:
            log.info(
                "suffix store warmed from %d records (%d tokens) in %.2f s",
                self.records,
                self.tokens,
                self.seconds,
            )

    def _read(self) -> list[tuple[list[int], str]]:
        """The newest records' tokens and routes, oldest first (unreadable ones skipped)."""
        client = connect(self.url)
        documents: list[tuple[list[int], str]] = []
        end = "+"
        while len(documents) < self.max_records:
            count = min(_PAGE, self.max_records - len(documents))
            entries: list[Any] = client.xrevrange(self.stream, max=end, count=count) or []
            for entry_id, fields in entries:
                end = f"({entry_id.decode() if isinstance(entry_id, bytes) else entry_id}"
                data = (fields or {}).get(b"r")
                if not isinstance(data, bytes):
                    continue
                try:
                    record = Record.unpack(data)
                except ValueError:  # another schema or garbled: the trainer's concern
                    continue
                documents.append((record.token_ids.tolist(), record.domain))
            if len(entries) < count:
                break
        client.close()
        documents.reverse()
        return documents
