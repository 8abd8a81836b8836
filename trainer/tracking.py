"""Where the trainer's numbers go: Weights & Biases (optional) and the progress log.

`config.wandb.mode`:

- ``offline`` (default): a local run under ``<wandb.dir or run_dir>/wandb``, synced later with
  ``wandb sync``; never touches the network.
- ``online``: streams to W&B, but only when an API key is configured (``WANDB_API_KEY`` or a
  ``wandb login`` entry in ``~/.netrc``); without one it says so and falls back to offline.
- ``disabled``: nothing is written and wandb is never imported.

wandb is imported only when a run is opened.
"""

from __future__ import annotations

import dataclasses
import logging
import netrc
import os
from pathlib import Path
from typing import Any, Protocol

from osd.config import OSDConfig

__all__ = ["NullTracker", "Tracker", "WandbTracker", "open_tracker", "wandb_key_configured"]

_log = logging.getLogger(__name__)


class Tracker(Protocol):
    """Receives one flat dict of numbers per training round."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    """Drops everything (wandb disabled)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class WandbTracker:
    """A wandb run; `close` finishes it (offline runs are then complete on disk)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @property
    def directory(self) -> str:
        return str(self.run.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_key_configured() -> bool:
    """Whether a W&B API key is available (environment or ~/.netrc), without importing wandb."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_tracker(config: OSDConfig, *, name: str = "trainer") -> Tracker:
    """Opens the run `config.wandb` asks for (see the module docstring)."""
    mode = config.wandb.mode
    if mode == "disabled":
        return NullTracker()
    if mode == "online" and not wandb_key_configured():
        _log.warning("wandb.mode is online but no W&B API key is configured; logging offline")
        mode = "offline"
    directory = Path(config.wandb.dir or config.run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    import wandb

    run = wandb.init(
        project=config.wandb.project,
        name=name,
        job_type="train",
        mode=mode,
        dir=str(directory),
        config=dataclasses.asdict(config),
        reinit="finish_previous",
    )
    _log.info("wandb %s run in %s", mode, run.dir)
    return WandbTracker(run)
