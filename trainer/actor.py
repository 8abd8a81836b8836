"""The worker as a Ray actor: `TrainerService` runs a `TrainerWorker` (or, with `trainer.pool`,
a `trainer.pool.PoolWorker`) on a background thread, so the actor keeps answering `stats` and
`stop` while it trains.

    handle = trainer_actor(config, redis_url, num_gpus=1)   # ray.remote(TrainerService)
    ray.get(handle.start.remote())
    ray.get(handle.stats.remote())
    ray.get(handle.stop.remote())

    handles = trainer_pool_actors(config, redis_url, workers=4, num_gpus=1)  # a pool, a GPU each

`TrainerService` itself has no Ray in it (tests and the embedded demo can use it in-process);
`trainer_actor` imports Ray only when called.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from osd.config import OSDConfig, config_from_dict

__all__ = ["TrainerService", "trainer_actor", "trainer_pool_actors"]

_log = logging.getLogger(__name__)


class TrainerService:
    """Owns one worker and the thread that runs it.

    Args:
        config: an `OSDConfig`, or its `dataclasses.asdict` form (what crosses to an actor).
        redis_url: the log buffer's (and redis store's) Redis.
        worker_kwargs: extra keyword arguments for `trainer.wiring.wire_trainer` (in-process use).
    """

    def __init__(
        self, config: OSDConfig | dict[str, Any], redis_url: str, **worker_kwargs: Any
    ) -> None:
        self.config: OSDConfig = (
            config if isinstance(config, OSDConfig) else config_from_dict(OSDConfig, config)
        )
        self.redis_url = redis_url
        self._worker_kwargs = worker_kwargs
        self._worker: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self) -> None:
        """Builds the worker (loads the draft, restores published versions) and starts it."""
        if self._thread is not None:
            raise RuntimeError("the trainer is already started")
        from trainer.tracking import open_tracker
        from trainer.wiring import wire_trainer

        kwargs = dict(self._worker_kwargs)
        kwargs.setdefault("tracker", open_tracker(self.config))
        if self.config.trainer.pool:
            from trainer.pool import PoolWorker

            self._worker = PoolWorker(self.config, self.redis_url, **kwargs)
        else:
            self._worker = wire_trainer(self.config, self.redis_url, **kwargs)
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._worker.run(self._stop)
        except Exception as exc:  # reported through stats(); the actor stays up to say so
            _log.exception("trainer worker failed")
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._worker.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """The worker's totals, its published versions, and whether it runs or failed."""
        if self._worker is None:
            return {"running": False}
        if self.config.trainer.pool:  # a pool worker: what it owns and owned
            totals, versions = self._worker.stats(), dict(self._worker.follower.versions)
        else:
            totals = self._worker.stats.as_dict()
            versions = dict(self._worker.publisher.versions)
        return {**totals, "versions": versions, "running": self.running, "error": self._error}

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stops after the current step, waits for the thread, returns the final stats."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.stats()


def trainer_actor(
    config: OSDConfig, redis_url: str, *, num_cpus: float = 1.0, num_gpus: float = 0.0
) -> Any:
    """Creates a `TrainerService` Ray actor (call `start` on it); needs `ray.init` first."""
    import ray

    remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(TrainerService)
    return remote_cls.remote(dataclasses.asdict(config), redis_url)


def trainer_pool_actors(
    config: OSDConfig,
    redis_url: str,
    *,
    workers: int,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
) -> list[Any]:
    """`workers` actors, each one worker of a pool (`trainer.pool`) with `num_gpus` of its own;
    call `start` on each. Ray places them; the pool shares the adapters out by itself."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    pooled = dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, pool=True, workers=1)
    )
    return [
        trainer_actor(pooled, redis_url, num_cpus=num_cpus, num_gpus=num_gpus)
        for _ in range(workers)
    ]
