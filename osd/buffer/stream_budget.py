"""The log stream's bound in bytes: a Redis memory budget turned into a ``MAXLEN ~`` trim point.

Issue 17 ("Bounded memory, planned"): a bound in entries (`log.maxlen`) says nothing about memory
when records range from 2 KB (8 generated tokens) to 50 KB (256). `StreamBudget` measures the
records the writer sends (an exponential moving average of their packed size), estimates what
Redis spends per entry, and trims the stream to ``max_bytes / bytes_per_entry`` entries, never
more than `maxlen`.

What Redis spends per entry was measured here (Redis 7.0, jemalloc, records larger than the
4 KB ``stream-node-max-bytes``, so one entry per stream node): 1.03-1.12 times the payload
(allocator size classes, node and ID overhead). The estimate takes 1.25 times the payload plus
64 bytes, the worst case of jemalloc's size classes (four per doubling), so the stream stays
under the budget rather than near it (docs/capacity.md).

When Redis refuses entries for memory anyway (its ``maxmemory`` reached by other keys; policy
``noeviction`` never evicts adapter versions), the stream gives way: the trim point drops to
three quarters of the stream's length and the writer trims the stream at once (``XTRIM`` runs
even when Redis is full), so logging resumes instead of failing until an operator steps in; it
grows back by 1 % of the budget per accepted batch.

Pure: no Redis, no clocks.
"""

from __future__ import annotations

__all__ = ["REDIS_BYTES_PER_PAYLOAD_BYTE", "REDIS_BYTES_PER_ENTRY", "StreamBudget"]

REDIS_BYTES_PER_PAYLOAD_BYTE = 1.25
REDIS_BYTES_PER_ENTRY = 64
_EWMA_ALPHA = 0.05
_SHRINK_WHEN_FULL = 0.75
_GROW_WHEN_ACCEPTED = 0.01
_MIN_SCALE = 0.01


class StreamBudget:
    """The trim point of a stream bounded by `maxlen` entries and, if > 0, `max_bytes` of memory.

    Args:
        maxlen: most entries, whatever their size (>= 1).
        max_bytes: Redis memory the stream may take; 0: entries only.
    """

    def __init__(self, maxlen: int, max_bytes: int = 0) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.maxlen, self.max_bytes = maxlen, max_bytes
        self.mean_payload_bytes = 0.0  # no record seen yet
        self.scale = 1.0  # < 1 after Redis refused entries for memory

    def observe(self, payload_bytes: int) -> None:
        """Counts one packed record of `payload_bytes` into the moving average."""
        mean = self.mean_payload_bytes or float(payload_bytes)
        self.mean_payload_bytes = mean + _EWMA_ALPHA * (payload_bytes - mean)

    @property
    def entry_bytes(self) -> float:
        """Estimated Redis memory per entry (0 before the first record)."""
        if not self.mean_payload_bytes:
            return 0.0
        return REDIS_BYTES_PER_PAYLOAD_BYTE * self.mean_payload_bytes + REDIS_BYTES_PER_ENTRY

    @property
    def budget_len(self) -> float:
        """Entries the budget allows: `maxlen`, or fewer when `max_bytes` says so."""
        if self.max_bytes and self.entry_bytes:
            return min(float(self.maxlen), self.max_bytes / self.entry_bytes)
        return float(self.maxlen)

    @property
    def trim_len(self) -> int:
        """The ``MAXLEN ~`` to send: `budget_len`, less after Redis was full; at least 1."""
        return max(1, int(self.budget_len * self.scale))

    def on_full(self, stream_len: int) -> None:
        """Redis refused entries for memory while the stream held `stream_len` entries: trim
        a quarter of them."""
        target = _SHRINK_WHEN_FULL * stream_len / self.budget_len
        self.scale = max(_MIN_SCALE, min(self.scale, target))

    def on_accepted(self) -> None:
        """A batch went through: let the trim point grow back towards the budget."""
        self.scale = min(1.0, self.scale + _GROW_WHEN_ACCEPTED)
