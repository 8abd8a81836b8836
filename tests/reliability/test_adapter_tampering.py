"""Tampered and mismatched adapter versions reach a serving replica: each is refused by its
watcher, serving goes on with the version it had, and every refusal is counted by reason.

Both stores (Redis and a directory) are attacked by writing their bytes directly, as someone with
write access to the store (not to the replica) could. docs/reliability.md, rows "adapter ...".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from osd.adapters import open_adapter_store
from osd.adapters.codec import LORA_CODEC, AdapterStore
from osd.adapters.lora import base_model_hash
from osd.adapters.manifest import AdapterSpec
from osd.buffer.redis_server import connect
from osd.versions.errors import PublishConflict
from osd.versions.store_dir import MANIFEST_FILE, DirectoryStore
from osd.versions.store_redis import RedisStore

from .conftest import Replica, metric, replica_adapter, running_replica, toy_config, wait_for

ADAPTER = "general"


class RawStore:
    """Direct access to the stored bytes of one backend, bypassing the store's checks."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        if isinstance(store, RedisStore):
            self._redis = connect(store.url)

    def _path(self, version: int, file: str) -> Path:
        assert isinstance(self.store, DirectoryStore)
        return self.store.root / ADAPTER / f"v{version}" / file

    def read_weights(self, version: int) -> bytes:
        if isinstance(self.store, RedisStore):
            return self._redis.get(f"osd:adapter:{ADAPTER}:v{version}:weights")
        return self._path(version, LORA_CODEC.payload_file).read_bytes()

    def write(self, version: int, weights: bytes, manifest: bytes | None = None) -> None:
        if isinstance(self.store, RedisStore):
            self._redis.set(f"osd:adapter:{ADAPTER}:v{version}:weights", weights)
            if manifest is not None:
                self._redis.set(f"osd:adapter:{ADAPTER}:v{version}:manifest", manifest)
            return
        for file, data in ((LORA_CODEC.payload_file, weights), (MANIFEST_FILE, manifest)):
            if data is not None:
                path = self._path(version, file)
                os.chmod(path, 0o644)  # published files are read-only; an attacker chmods
                path.write_bytes(data)

    def vouch(self, version: int, weights: bytes) -> None:
        """Replaces the weights and fixes the manifest's sha256 and size to match them."""
        manifest = json.loads(self.store.manifest(ADAPTER, version).to_json())
        manifest["weights_sha256"] = hashlib.sha256(weights).hexdigest()
        manifest["num_weight_bytes"] = len(weights)
        self.write(version, weights, json.dumps(manifest).encode())


@dataclass
class Rig:
    """A replica following a store, raw access to that store, and replica-shaped weights."""

    replica: Replica
    store: AdapterStore
    raw: RawStore
    spec: AdapterSpec
    identity: dict[str, torch.Tensor]
    tmp: Path

    def stage(self, weights: dict[str, torch.Tensor], spec: AdapterSpec | None = None) -> int:
        """Stores a version without making it current (its publisher lost the race)."""
        with pytest.raises(PublishConflict) as conflict:
            self.store.publish(ADAPTER, weights, spec=spec or self.spec, expected_current=None)
        return conflict.value.new

    def point_at(self, version: int) -> None:
        """Moves the pointer to `version` and notifies, as a publish does."""
        self.store.rollback(ADAPTER, version, expected_current=self.store.current(ADAPTER))


@pytest.fixture(scope="module", params=["redis", "directory"])
def rig(request, module_redis, tmp_path_factory) -> Iterator[Rig]:
    """A replica following a store of each kind, at a good version 1."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "redis":
        store: AdapterStore = open_adapter_store(module_redis.url)
    else:
        store = open_adapter_store(tmp / "store", poll_interval_s=0.2)
    with running_replica(toy_config(), store=store) as replica:
        spec, identity = replica_adapter(replica.runtime.slots.model)
        good = store.publish(ADAPTER, identity, spec=spec, expected_current=None).version
        wait_for(lambda: replica.current() == good, 10)
        yield Rig(replica, store, RawStore(store), spec, identity, tmp)
    if isinstance(store, RedisStore):
        store.close()


def _flip_a_byte(rig: Rig, version: int) -> None:
    payload = bytearray(rig.raw.read_weights(version))
    payload[len(payload) // 2] ^= 0xFF
    rig.raw.write(version, bytes(payload))


def _truncate(rig: Rig, version: int) -> None:
    rig.raw.write(version, rig.raw.read_weights(version)[:-64])


def _truncate_and_vouch(rig: Rig, version: int) -> None:
    rig.raw.vouch(version, rig.raw.read_weights(version)[:-64])


class _TouchOnLoad:
    """Unpickling this creates a file: proof that pickled code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (Path.touch, (self.path,))


def _pickle_disguised_as_weights(rig: Rig, version: int) -> None:
    payload = pickle.dumps({"lora_A": _TouchOnLoad(rig.tmp / "pwned")})
    rig.raw.vouch(version, payload)


def test_the_disguised_pickle_runs_code_when_unpickled(tmp_path):
    """Negative control for the pickle case: the payload is live, so "no file" means "never
    unpickled", not "harmless"."""
    pickle.loads(pickle.dumps({"lora_A": _TouchOnLoad(tmp_path / "pwned")}))  # noqa: S301
    assert (tmp_path / "pwned").exists()


def _non_finite_weights(rig: Rig, version: int) -> None:
    weights = {k: v.clone() for k, v in rig.identity.items()}
    next(iter(weights.values()))[0, 0] = float("nan")
    rig.raw.vouch(version, safetensors.torch.save(weights, metadata={"format": "pt"}))


def _rank(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {
        k: (v[:rank].clone() if "lora_A" in k else v[:, :rank].clone()) for k, v in weights.items()
    }


# (case, how the bad version is stored, the refusal reason /metrics must count)
STORED_THEN_DAMAGED = [
    ("wrong_sha256", _flip_a_byte, "sha256_mismatch"),
    ("truncated", _truncate, "size_mismatch"),
    ("truncated_with_forged_manifest", _truncate_and_vouch, "not_safetensors"),
    ("pickle_disguised_as_weights", _pickle_disguised_as_weights, "not_safetensors"),
    ("non_finite_with_forged_manifest", _non_finite_weights, "non_finite"),
]


def _foreign_base_model(rig: Rig) -> int:
    target = rig.replica.runtime.engine.target.model  # same architecture, other weights
    spec = dataclasses.replace(rig.spec, base_model_hash=base_model_hash(target))
    return rig.stage(rig.identity, spec)


def _wrong_rank(rig: Rig) -> int:
    return rig.stage(_rank(rig.identity, 4), dataclasses.replace(rig.spec, rank=4))


def _missing_module(rig: Rig) -> int:
    return rig.stage(dict(list(rig.identity.items())[1:]))


PUBLISHED_MISMATCHED = [
    ("foreign_base_model", _foreign_base_model, "base_model_mismatch"),
    ("wrong_rank", _wrong_rank, "shape_mismatch"),
    ("missing_module", _missing_module, "shape_mismatch"),
]


def _assert_refused_and_serving_on(rig: Rig, bad: int, good: int, reason: str) -> None:
    replica = rig.replica
    before = metric(replica.metrics(), "osd_adapter_refusals_total", adapter=ADAPTER, reason=reason)
    rig.point_at(bad)
    refused_s = wait_for(
        lambda: any(
            e["event"] == "refused" and e["version"] == bad
            for e in replica.health()["adapter_events"]
        ),
        10,
    )
    after = metric(replica.metrics(), "osd_adapter_refusals_total", adapter=ADAPTER, reason=reason)
    responses = [replica.complete(draft=ADAPTER) for _ in range(3)]
    event = next(e for e in replica.health()["adapter_events"] if e["version"] == bad)
    print(f"\n[tamper] v{bad} refused in {refused_s:.2f} s ({reason}): {event['reason'][:100]}")
    assert after == before + 1
    assert replica.current() == good
    assert [r.status_code for r in responses] == [200] * 3
    assert {r.json()["osd"]["adapter_version"] for r in responses} == {good}
    assert rig.store.current(ADAPTER) == bad  # the pointer still names it; the replica refuses


@pytest.mark.parametrize(
    ("damage", "reason"),
    [pytest.param(damage, reason, id=case) for case, damage, reason in STORED_THEN_DAMAGED],
)
def test_damaged_version_is_refused_and_serving_continues_on_the_current_one(rig, damage, reason):
    good = rig.replica.current()
    bad = rig.stage(rig.identity)
    damage(rig, bad)
    _assert_refused_and_serving_on(rig, bad, good, reason)
    assert not (rig.tmp / "pwned").exists()  # no pickle was ever loaded


@pytest.mark.parametrize(
    ("stage", "reason"),
    [pytest.param(stage, reason, id=case) for case, stage, reason in PUBLISHED_MISMATCHED],
)
def test_version_for_another_model_or_layout_is_refused_and_serving_continues(rig, stage, reason):
    good = rig.replica.current()
    _assert_refused_and_serving_on(rig, stage(rig), good, reason)


def test_good_version_after_refusals_is_swapped_in(rig):
    current = rig.store.current(ADAPTER)
    good = rig.store.publish(ADAPTER, rig.identity, spec=rig.spec, expected_current=current)
    wait_for(lambda: rig.replica.current() == good.version, 10)
    assert rig.replica.complete(draft=ADAPTER).json()["osd"]["adapter_version"] == good.version
