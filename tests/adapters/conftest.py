"""Fixtures for the trainer core: tiny peft drafts, and adapter stores on both backends (a temp
directory, and a real redis-server started with LocalRedis) with raw access for fault tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from osd.adapters import open_adapter_store
from osd.adapters.codec import LORA_CODEC, AdapterStore
from osd.adapters.lora import adapter_spec, lora_state_dict
from osd.adapters.manifest import AdapterSpec
from osd.buffer.redis_server import LocalRedis, connect
from osd.testing import tiny_llama, with_lora_adapters
from osd.versions.store_dir import MANIFEST_FILE, DirectoryStore

BASE_MODEL_ID = "tiny-llama-test"


def tiny_base(seed: int = 0, hidden_size: int = 32):
    return tiny_llama(vocab_size=32, hidden_size=hidden_size, num_layers=1, seed=seed)


@pytest.fixture(scope="session")
def trainer_draft():
    """The trainer's peft draft: base seed 0 with rank-4 adapters "code" and "sql"."""
    return with_lora_adapters(tiny_base(), ["code", "sql"], seed=1)


@pytest.fixture(scope="session")
def spec(trainer_draft) -> AdapterSpec:
    return adapter_spec(trainer_draft, "code", BASE_MODEL_ID)


@pytest.fixture(scope="session")
def code_weights(trainer_draft):
    return lora_state_dict(trainer_draft, "code")


@pytest.fixture(scope="session")
def sql_weights(trainer_draft):
    return lora_state_dict(trainer_draft, "sql")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One redis-server for the session; tests use fresh adapter names."""
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def adapter_name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


class RawAccess:
    """Reads and writes a backend's stored bytes behind the store's back, as a crash, a disk
    error or an attacker would."""

    def __init__(self, store: AdapterStore, redis_url: str | None) -> None:
        self.store = store
        self.client: redis.Redis | None = connect(redis_url) if redis_url else None

    def _path(self, name: str, version: int, file: str) -> Path:
        assert isinstance(self.store, DirectoryStore)
        return self.store.root / name / f"v{version}" / file

    def _overwrite(self, path: Path, data: bytes) -> None:
        os.chmod(path, 0o644)
        path.write_bytes(data)

    def read_weights(self, name: str, version: int) -> bytes:
        if self.client is not None:
            return self.client.get(f"osd:adapter:{name}:v{version}:weights")
        return self._path(name, version, LORA_CODEC.payload_file).read_bytes()

    def write_weights(self, name: str, version: int, data: bytes) -> None:
        if self.client is not None:
            self.client.set(f"osd:adapter:{name}:v{version}:weights", data)
        else:
            self._overwrite(self._path(name, version, LORA_CODEC.payload_file), data)

    def write_manifest(self, name: str, version: int, data: bytes) -> None:
        if self.client is not None:
            self.client.set(f"osd:adapter:{name}:v{version}:manifest", data)
        else:
            self._overwrite(self._path(name, version, MANIFEST_FILE), data)

    def crash_after_weights(self, name: str, payload: bytes) -> int:
        """What a publisher leaves when it dies after writing the weights of a new version:
        the number is allocated (the store's own first step), the weights are written, nothing
        else. Returns the version number."""
        version = self.store._allocate_version(name)
        if self.client is not None:
            self.client.set(f"osd:adapter:{name}:v{version}:weights", payload)
        else:
            tmp = self.store.root / name / f".tmp-v{version}-crashed"
            tmp.mkdir()
            (tmp / LORA_CODEC.payload_file).write_bytes(payload)
        return version


@pytest.fixture(params=["directory", "redis"])
def backend(request, tmp_path) -> str:
    return request.param


def make_store(backend: str, tmp_path: Path, request, **kwargs) -> AdapterStore:
    if backend == "directory":
        return open_adapter_store(tmp_path / "adapters", poll_interval_s=0.02, **kwargs)
    store = open_adapter_store(request.getfixturevalue("redis_url"), **kwargs)
    request.addfinalizer(store.close)
    return store


@pytest.fixture
def store(backend, tmp_path, request) -> AdapterStore:
    return make_store(backend, tmp_path, request)


@pytest.fixture
def other_store(backend, tmp_path, request) -> AdapterStore:
    """A second store instance on the same storage: another trainer or a replica."""
    return make_store(backend, tmp_path, request)


@pytest.fixture
def raw(store, backend, request) -> RawAccess:
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    access = RawAccess(store, url)
    if access.client is not None:
        request.addfinalizer(access.client.close)
    return access
