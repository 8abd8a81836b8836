"""Between the trainer's adapters and the adapter store: restore, publish with compare-and-set.

Each adapter's state (`trainer.adapter_state.AdapterState.version`) remembers the store version
its weights descend from. Publishing moves
the store's pointer only if it still names that version (`VersionedStore.publish(...,
expected_current=...)`); if another trainer, or a replica's rollback, moved it meanwhile, the
store raises `PublishConflict`, the new version stays stored but not current, and the trainer
reloads the version that is current into both slots and goes on training from it (after a
rollback to the base draft, `BASE_VERSION`, it starts over from the base draft). Nothing is ever
clobbered.

After each publish the store deletes the versions no one needs any more
(`VersionedStore.collect_garbage`: `keep_versions` predecessors, held and young versions stay), so
the store's memory stays bounded; a failure there is logged and tried again next time.

An adapter with no version yet (a new domain's) can start from another adapter's current version
(`start_from_best`): the one that does best on its records, if any beats the base draft.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from osd.adapters.codec import AdapterStore
from osd.adapters.lora import base_model_hash
from osd.adapters.manifest import AdapterManifest
from osd.buffer.record import Record
from osd.config import TrainerConfig
from osd.versions.errors import BASE_VERSION, PublishConflict, StoreError, StoreUnavailable
from trainer.adapter_state import AdapterState, AdapterVersions, adapter_states
from trainer.draft_trainer import DraftTrainer

__all__ = ["Publisher"]

_log = logging.getLogger(__name__)


class Publisher:
    """Publishes `trainer`'s candidates to `store`, one version lineage per adapter.

    Args:
        store: the adapter store the replicas follow.
        trainer: holds the candidate and current slots of every adapter.
        states: each adapter's state, whose `version` this keeps (default: fresh states with
            no version, for tools and tests that publish without a worker).
        keep_versions, gc_grace_s: the bounded history (`adapters.keep_versions`,
            `adapters.gc_grace_s`); see `VersionedStore.collect_garbage`.
    """

    def __init__(
        self,
        store: AdapterStore,
        trainer: DraftTrainer,
        states: Mapping[str, AdapterState] | None = None,
        *,
        keep_versions: int = 4,
        gc_grace_s: float = 60.0,
    ) -> None:
        self.store, self.trainer = store, trainer
        self.keep_versions, self.gc_grace_s = keep_versions, gc_grace_s
        self.base_hash = base_model_hash(trainer.model)
        self.states = states or adapter_states(TrainerConfig(), list(trainer.adapters))
        self.versions = AdapterVersions(self.states)  # read-only; the states hold them
        self.num_conflicts = self.num_deleted = 0

    def restore(self, adapter: str) -> int | None:
        """Loads the store's current version of `adapter` into both slots.

        A version that does not load (another base draft, wrong layout, damaged) is skipped with
        a warning: the slots keep their weights, and the next publish replaces it.

        Returns:
            The current version (None when none was published), now the expected one.

        Raises:
            StoreUnavailable: the store cannot be reached; nothing changed, so the next
                publish still expects the version these weights really descend from (and
                conflicts, and restores again, if the pointer moved).
        """
        version = self.store.current(adapter)
        if version == BASE_VERSION:  # a replica rolled the adapter back to the base draft
            self.trainer.reset_to_base(adapter)
            _log.warning("%s: rolled back to the base draft; training from it again", adapter)
        elif version is not None:
            self._load(adapter, version)
        self.states[adapter].version = version  # only once nothing raised StoreUnavailable
        return version

    def _load(self, adapter: str, version: int) -> None:
        try:
            manifest, weights = self.store.load(
                adapter,
                version,
                expected_base_model_hash=self.base_hash,
                expected_shapes=self.trainer.shapes(adapter),
            )
        except StoreUnavailable:
            raise
        except (StoreError, ValueError) as exc:
            _log.warning("%s v%d does not load (%s); training on without it", adapter, version, exc)
            return
        self.trainer.set_weights(adapter, weights, ["candidate", "current"])
        _log.info(
            "%s: resuming from v%d (acceptance estimate %s)",
            adapter,
            version,
            manifest.acceptance_estimate,
        )

    def start_from_best(self, adapter: str, records: Sequence[Record]) -> str | None:
        """Starts the candidate of `adapter`, which has no version yet, from the current version
        of the adapter that does best on `records` (its hold-out records), if one beats the base
        draft there. Its current slot stays the base draft: that is what replicas serve for it
        until its first version, so what the judge compares candidates with.

        Returns:
            The adapter it starts from, or None (it has a version, or none beats the base).
        """
        if self.versions[adapter] is not None or not records:
            return None
        sources = [a for a in self.trainer.adapters if a != adapter and self.versions[a]]
        if not sources:
            return None
        base = self.trainer.estimate(adapter, "current", records).lower
        scores = {a: self.trainer.estimate(a, "current", records).lower for a in sources}
        best = max(scores, key=lambda a: scores[a])
        if scores[best] <= base:
            return None
        weights = self.trainer.weights(best, "current")
        self.trainer.set_weights(adapter, weights, ["candidate"])
        _log.info(
            "%s: starts from %s v%s (acceptance %.4f vs base draft %.4f on %d records)",
            adapter,
            best,
            self.versions[best],
            scores[best],
            base,
            len(records),
        )
        return best

    def publish(self, adapter: str, acceptance_estimate: float) -> AdapterManifest | None:
        """Publishes the candidate of `adapter` over the version it descends from.

        Returns:
            The new manifest, or None after a conflict (the winner's version is then loaded).
        """
        expected = self.versions[adapter]
        try:
            manifest = self.store.publish(
                adapter,
                self.trainer.weights(adapter),
                spec=self.trainer.spec(adapter),
                expected_current=expected,
                acceptance_estimate=min(1.0, max(0.0, acceptance_estimate)),
            )
        except PublishConflict as exc:
            self.num_conflicts += 1
            _log.warning(
                "%s: publish conflict (%s); reloading the current version and training on",
                adapter,
                exc,
            )
            self.restore(adapter)
            return None
        self.states[adapter].version = manifest.version
        self.trainer.promote(adapter)
        self.collect_garbage(adapter)
        return manifest

    def collect_garbage(self, adapter: str) -> list[int]:
        """Deletes the versions of `adapter` outside its bounded history; returns them. Never
        raises for the store: old versions wait for the next publish."""
        try:
            deleted = self.store.collect_garbage(
                adapter, keep_versions=self.keep_versions, grace_s=self.gc_grace_s
            )
        except StoreError as exc:
            _log.warning("%s: old versions not deleted now (%s)", adapter, exc)
            return []
        if deleted:
            self.num_deleted += len(deleted)
            _log.info("%s: deleted old versions %s", adapter, deleted)
        return deleted
