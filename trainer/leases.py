"""Who in a pool of trainer workers owns what: leases in Redis, renewed with a heartbeat.

Keys (`S` the log stream, `G` the trainer's consumer group):

- ``S:trainer:G:lease:<name>``: the owner's worker id, expiring after `lease_s` unless renewed.
  `<name>` is an adapter, or `DISPATCH` (reading the log and routing its records, which includes
  fitting the routing model: one worker at a time);
- ``S:trainer:G:alive``: a sorted set, worker id -> Redis time (ms) of its last renewal: the
  live workers are those renewed within `lease_s`.

A thread renews every held lease and the worker's liveness each `lease_s / 3`, so a long round
keeps its leases. A renewal that finds another owner (the lease ran out) makes that lease lost;
a worker whose renewals all failed for `lease_s / 2` (Redis away, or the process paused) counts
every lease as lost, so it stops using them before another worker can take them (after
`lease_s`). Whoever uses a lease checks `lost()` before each step.

Balance (`balance`): the live workers split the adapters evenly (`share`: the first by id take
one more while it does not come out even). Each gives up the adapters beyond its share and takes
free ones while it has fewer; so a new worker gets its share as the others give theirs up, and a
dead worker's adapters go to the others once its leases and its liveness run out. Nothing is
ever taken from a live owner.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import redis

from osd.buffer.redis_server import connect
from osd.closing import Closeable

__all__ = ["DISPATCH", "LeaseTable", "lease_key", "pool_prefix"]

_log = logging.getLogger(__name__)
DISPATCH = "@dispatch"

# Renew (or release) a lease only if this worker still holds it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Take a lease that is free, or this worker's already (it outlived a Redis restart).
_ACQUIRE = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if owner then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def pool_prefix(stream: str, group: str) -> str:
    """The prefix of a pool's keys (beside the trainer's heartbeat, `S:trainer:G`)."""
    return f"{stream}:trainer:{group}"


def lease_key(stream: str, group: str, name: str) -> str:
    return f"{pool_prefix(stream, group)}:lease:{name}"


class LeaseTable(Closeable):
    """This worker's leases.

    Args:
        url: the log's Redis.
        stream, group: the log stream and the trainer's consumer group (the pool).
        worker_id: this worker's unique id (its consumer name).
        adapters: the configured adapters, general first (the order they are taken in).
        lease_s: how long a lease outlives its last renewal.
    """

    def __init__(
        self,
        url: str,
        stream: str,
        group: str,
        worker_id: str,
        adapters: Sequence[str],
        *,
        lease_s: float = 10.0,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.stream, self.group, self.worker_id = stream, group, worker_id
        self.adapters, self.lease_s = list(adapters), lease_s
        self.alive_key = f"{pool_prefix(stream, group)}:alive"
        self._client = connect(url, socket_timeout_s=max(0.1, min(5.0, lease_s / 4)))
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)
        self._acquire = self._client.register_script(_ACQUIRE)
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}  # name -> monotonic time it was taken
        self._lost: set[str] = set()
        self._renewed_at = time.monotonic()
        # Called on the renewal thread with the names just lost (before `lost()` returns them).
        self.on_lost: Callable[[list[str]], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-leases", daemon=True)

    def key(self, name: str) -> str:
        return lease_key(self.stream, self.group, name)

    # What is held.

    def held(self) -> list[str]:
        """The leases held now, adapters in configured order (then `DISPATCH`)."""
        order = [*self.adapters, DISPATCH]
        with self._lock:
            return [n for n in order if n in self._held]

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self._held

    def lost(self) -> set[str]:
        """Leases lost since the last call (no longer held): their users must stop now."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    # Taking and giving up.

    def acquire(self, name: str) -> bool:
        """Takes `name` if no one holds it (or this worker still does), unless its loss is
        still to be handled (`lost()`): its user must stop first."""
        with self._lock:
            if name in self._lost:
                return False
        try:
            taken = bool(self._acquire(keys=[self.key(name)], args=[self.worker_id, self._ms()]))
        except redis.RedisError as exc:
            _log.warning("leases: cannot take %s (%s)", name, exc)
            return False
        if taken:
            with self._lock:
                self._held[name] = time.monotonic()
            _log.info("%s: took %s", self.worker_id, name)
        return taken

    def release(self, name: str) -> None:
        """Gives `name` up (after its user stopped using it)."""
        with self._lock:
            self._held.pop(name, None)
        try:
            self._release(keys=[self.key(name)], args=[self.worker_id])
        except redis.RedisError as exc:  # it runs out by itself
            _log.warning(
                "leases: cannot release %s (%s); it expires in %.0f s", name, exc, self.lease_s
            )
        _log.info("%s: gave up %s", self.worker_id, name)

    def owner(self, name: str) -> str | None:
        """Who holds `name` now (None: no one, or Redis did not answer)."""
        try:
            owner = self._client.get(self.key(name))
        except redis.RedisError:
            return None
        return owner.decode() if isinstance(owner, bytes) else owner

    def live_workers(self) -> list[str]:
        """The workers renewed within `lease_s` (this one included once it renewed)."""
        now_ms = self._now_ms()
        members = self._client.zrangebyscore(self.alive_key, now_ms - self._ms(), "+inf")
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    def share(self, live: Sequence[str]) -> int:
        """This worker's share of the adapters among the `live` ones: an even split, the first
        workers by id taking one more while it does not come out even (3 adapters, 2 workers:
        2 and 1; 4 adapters, 3 workers: 2, 1 and 1), so every live worker gets one while there
        are enough."""
        if self.worker_id not in live:  # not counted yet: what an even split would give
            return math.ceil(len(self.adapters) / (len(live) + 1))
        base, extra = divmod(len(self.adapters), len(live))
        return base + (sorted(live).index(self.worker_id) < extra)

    def fresh(self) -> bool:
        """Whether the leases were renewed within `lease_s / 2` (false in a process that was
        paused, before its renewal thread notices): rounds stop on a stale lease."""
        return time.monotonic() - self._renewed_at <= self.lease_s / 2

    def balance(self) -> tuple[list[str], list[str]]:
        """Takes free adapters up to this worker's share; says which to give up.

        Returns:
            (adapters taken now, adapters beyond its share that it should give up, newest
            first: the caller stops using them, then calls `release`).
        """
        try:
            live = self.live_workers()
        except redis.RedisError as exc:
            _log.warning("leases: cannot read the pool (%s)", exc)
            return [], []
        share = self.share(live)
        mine = [a for a in self.held() if a != DISPATCH]
        if len(mine) > share:
            with self._lock:
                newest = sorted(mine, key=lambda a: -self._held.get(a, 0.0))
            return [], newest[: len(mine) - share]
        taken: list[str] = []
        for adapter in self.adapters:
            if len(mine) + len(taken) >= share:
                break
            if adapter not in mine and self.acquire(adapter):
                taken.append(adapter)
        return taken, []

    # Renewal.

    def start(self) -> LeaseTable:
        self.renew()
        self._thread.start()
        return self

    def renew(self) -> bool:
        """Renews every held lease and this worker's liveness once; False when Redis did not
        answer (after `lease_s / 2` of that, every lease counts as lost)."""
        names = self.held()
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.zadd(self.alive_key, {self.worker_id: self._now_ms()})
            pipe.zremrangebyscore(self.alive_key, "-inf", self._now_ms() - 10 * self._ms())
            pipe.execute()
            kept = [
                self._renew(keys=[self.key(n)], args=[self.worker_id, self._ms()]) for n in names
            ]
        except redis.RedisError as exc:
            if time.monotonic() - self._renewed_at > self.lease_s / 2:
                self._lose(names, f"no renewal for {self.lease_s / 2:.1f} s ({exc})")
            return False
        self._renewed_at = time.monotonic()
        self._lose([n for n, ok in zip(names, kept, strict=True) if not ok], "taken over")
        return True

    def _lose(self, names: Sequence[str], why: str) -> None:
        if not names:
            return
        with self._lock:
            gone = [n for n in names if self._held.pop(n, None) is not None]
            self._lost.update(gone)
        if gone and self.on_lost is not None:
            self.on_lost(gone)
        _log.warning("%s: lost %s: %s", self.worker_id, ", ".join(names), why)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - the thread must not die: leases would go stale
                _log.exception("leases: renewal failed")

    def close(self) -> None:
        """Stops renewing, gives every lease up and leaves the pool."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.lease_s)
        for name in self.held():
            self.release(name)
        with contextlib.suppress(redis.RedisError):
            self._client.zrem(self.alive_key, self.worker_id)
        self._client.close()

    def _ms(self) -> int:
        return int(self.lease_s * 1000)

    def _now_ms(self) -> int:
        seconds, micros = self._client.time()
        return int(seconds) * 1000 + int(micros) // 1000
