"""The draft adapters as the version watcher sees them: peft slots, and the rollback rule.

`serving.watcher.VersionWatcher` follows the adapter store; this holder installs a checked
version into the replica's peft slots (`serving.adapter_slots`) for new requests, keeps the
previous one loaded while the new one is unproven, and judges: a current version whose live
acceptance (`serving.live_monitor`) is worse than its predecessor's over a window is rolled back.
"""

from __future__ import annotations

import functools
from typing import Any

from osd.adapters.lora import base_model_hash, install_adapter, lora_shapes
from osd.versions.errors import BASE_VERSION
from serving.adapter_slots import AdapterSlots, peft_adapter_name
from serving.live_monitor import LiveMonitor
from serving.metrics import ReplicaMetrics
from serving.watcher import Verdict

__all__ = ["AdapterHolder"]


def _base_draft_stays_loaded(model: Any, peft_name: str) -> None:
    raise RuntimeError(f"{peft_name} (the base draft) should never have been unloaded")


class AdapterHolder:
    """One replica's adapter slots, judged by the live monitor, counted in the metrics."""

    label = None

    def __init__(self, slots: AdapterSlots, monitor: LiveMonitor, metrics: ReplicaMetrics) -> None:
        self.slots, self.monitor, self.metrics = slots, monitor, metrics
        self.names = tuple(slots.adapters)
        self.base_hash = base_model_hash(slots.model)
        # The layout every version must have, read before version 0 may be unloaded.
        self.shapes = {
            name: lora_shapes(slots.model, peft_adapter_name(name, 0)) for name in self.names
        }

    def current(self, name: str) -> int:
        return self.slots.current(name)

    def held(self, name: str) -> list[int]:
        previous = self.slots.previous(name)
        return [self.slots.current(name)] + ([] if previous is None else [previous])

    def expected(self, name: str) -> dict[str, Any]:
        return {"expected_base_model_hash": self.base_hash, "expected_shapes": self.shapes[name]}

    def install(self, name: str, version: int, manifest: Any, artefact: Any) -> dict[str, Any]:
        install = _base_draft_stays_loaded
        if version != BASE_VERSION:  # a rollback to the base draft loads nothing
            install = functools.partial(install_adapter, manifest=manifest, weights=artefact)
        self.slots.swap_in(name, version, install, keep_previous=self._unproven(name))
        return {}

    def _unproven(self, name: str) -> bool:
        """Whether the current version never served a full window while its predecessor did:
        it is replaced before it could be judged, so the predecessor stays the baseline (else a
        quick succession of versions would never be compared with anything)."""
        slots = self.slots
        previous = slots.previous(name)
        return (
            previous is not None
            and self.monitor.rate(name, slots.current(name)) is None
            and self.monitor.rate(name, previous) is not None
        )

    def verdict(self, name: str) -> Verdict | None:
        """Rollback when the current version's live acceptance is worse than its
        predecessor's; never "kept": the predecessor stays loaded until the next version."""
        current, previous = self.slots.current(name), self.slots.previous(name)
        if previous is None or not self.monitor.is_worse(name, current, previous):
            return None
        rates = {
            "new_rate": self.monitor.rate(name, current),
            "old_rate": self.monitor.rate(name, previous),
        }
        return Verdict("rollback", previous, rates)

    def roll_back(self, name: str, to_version: int) -> None:
        self.slots.roll_back(name, to_version)

    def count(self, event: str, name: str, reason: str | None = None) -> None:
        if event == "swap":
            self.metrics.adapter_swapped(name)
        elif event == "refused":
            self.metrics.adapter_refused(name, reason or "unknown")
        elif event == "rollback":
            self.metrics.adapter_rolled_back(name)
