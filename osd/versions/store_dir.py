"""The versioned store on a shared filesystem (local disk, NFS with working `flock`).

Layout under `root`::

    <name>/v<version>/<payload_file>        the codec's payload (`adapter.safetensors`),
                                            read-only once published
    <name>/v<version>/manifest.json         the codec's manifest, read-only once published
    <name>/CURRENT                          the pointer: the current version number
    <name>/LAST_VERSION                     the last version number handed out
    <name>/.lock                            `flock`ed around allocation and pointer moves
    <name>/.tmp-*                           versions being written or deleted; never read
                                            (removed by a later publish once an hour old)
    .held/<replica-id>.json                 what a replica holds (`report_held`); stale once
                                            older than its TTL by the file server's clock

A version is written into a fresh `.tmp-*` directory (files and directory fsynced) and renamed to
`v<version>` in one `os.rename`, so `v<version>` either does not exist or is complete. The pointer
is replaced with `os.replace` under the lock, after checking that it still names the expected
version (compare-and-set). A version is deleted under the same lock, unless the pointer names it,
by renaming it to a `.tmp-*` name first, so a reader finds it whole or not at all (a file already
open reads on). There is no message channel: `subscribe` polls the pointers.

Filesystem errors that may pass by themselves (disk full, over quota, I/O or network-filesystem
trouble) raise `StoreUnavailable`, like a Redis outage: a trainer keeps training and
publishes later, a replica fetches again. Others (permissions, a read-only mount) raise
`StoreError`: a deployment to fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from osd.versions.codec import Codec
from osd.versions.errors import (
    BASE_VERSION,
    PointerEvent,
    PublishConflict,
    StoreError,
    StoreUnavailable,
    check_name,
)
from osd.versions.retention import decode_held
from osd.versions.store import DEFAULT_MAX_BYTES, Subscription, VersionedStore

__all__ = ["DirectoryStore", "PointerPollSubscription"]

MANIFEST_FILE = "manifest.json"
HELD_DIR = ".held"
_VERSION_DIR_RE = re.compile(r"v([1-9][0-9]*)")


_TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN}
    | {errno.EBUSY, errno.ENOMEM, errno.EINTR}
)
_STALE_TEMP_S = 3600.0  # a `.tmp-*` this old was left by a killed publish


@contextlib.contextmanager
def _os_errors(what: str) -> Iterator[None]:
    """Raises the store's error for an `OSError` while doing `what`."""
    try:
        yield
    except OSError as exc:
        kind = StoreUnavailable if exc.errno in _TRANSIENT_ERRNOS else StoreError
        raise kind(f"could not {what}: {exc}") from exc


def _remove_stale_temps(directory: Path, fresh: Path) -> None:
    """Removes what killed publishes left behind; a publish in progress is far younger. Ages
    are measured against `fresh`, just created, so by the file server's clock, not ours."""
    cutoff = fresh.stat().st_mtime - _STALE_TEMP_S
    for entry in directory.glob(".*tmp-*"):
        with contextlib.suppress(OSError):
            if entry != fresh and entry.lstat().st_mtime < cutoff:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes, mode: int = 0o644) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(path, mode)


def _replace_durably(path: Path, data: bytes) -> None:
    """Replaces the file at `path` atomically: a reader sees the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        _write_durably(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise StoreError(f"{path} should hold a version number, holds {text[:40]!r}")
    return int(text)


class DirectoryStore(VersionedStore[Any, Any]):
    """Versions as files under `root`, shared by trainers and replicas.

    Args:
        root: the store's directory; created if missing.
        codec: what a version holds (`osd.versions.codec`).
        max_bytes: largest payload file accepted.
        poll_interval_s: how often `subscribe` re-reads the pointers.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        codec: Codec[Any, Any],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        poll_interval_s: float = 1.0,
    ) -> None:
        super().__init__(codec, max_bytes=max_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.poll_interval_s = poll_interval_s

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r}, {self.codec.kind})"

    def close(self) -> None:
        """Nothing to free: files are opened per call."""

    def _dir(self, name: str) -> Path:
        check_name(name, self.codec.kind)
        return self.root / name

    def _version_dir(self, name: str, version: int) -> Path:
        return self._dir(name) / f"v{version}"

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[Path]:
        """Holds the name's lock file; each call opens it anew, so threads exclude too."""
        directory = self._dir(name)
        directory.mkdir(exist_ok=True)
        with open(directory / ".lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield directory
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def current(self, name: str) -> int | None:
        with _os_errors(f"read the pointer of {name!r}"):
            return _read_int(self._dir(name) / "CURRENT")

    def list_versions(self, name: str) -> list[int]:
        directory = self._dir(name)
        versions = []
        with _os_errors(f"list the versions of {name!r}"):
            if not directory.is_dir():
                return []
            for entry in directory.iterdir():
                match = _VERSION_DIR_RE.fullmatch(entry.name)
                if match and (entry / MANIFEST_FILE).is_file():
                    versions.append(int(match.group(1)))
        return sorted(versions)

    def names(self) -> list[str]:
        found = []
        with _os_errors(f"list the names under {self.root}"):
            for entry in self.root.iterdir():
                with contextlib.suppress(ValueError):
                    if entry.is_dir() and self.list_versions(entry.name):
                        found.append(entry.name)
        return sorted(found)

    def subscribe(self) -> PointerPollSubscription:
        """Polls every pointer each `poll_interval_s`; see `PointerPollSubscription`."""
        return PointerPollSubscription(self, self.poll_interval_s)

    def _allocate_version(self, name: str) -> int:
        with _os_errors(f"allocate a version of {name!r}"), self._locked(name) as directory:
            last = max([_read_int(directory / "LAST_VERSION") or 0, *self.list_versions(name)])
            _replace_durably(directory / "LAST_VERSION", f"{last + 1}\n".encode())
        return last + 1

    def _write_version(self, manifest: Any, payload: bytes) -> None:
        directory = self._dir(manifest.name)
        tmp = directory / f".tmp-v{manifest.version}-{uuid.uuid4().hex}"
        with _os_errors(f"store {manifest.ref} under {directory}"):
            tmp.mkdir()
            _remove_stale_temps(directory, tmp)
            try:
                _write_durably(tmp / self.codec.payload_file, payload, mode=0o444)
                _write_durably(tmp / MANIFEST_FILE, manifest.to_json(), mode=0o444)
                _fsync_dir(tmp)
                # Fails if the version exists (a non-empty directory): never rewritten.
                os.rename(tmp, directory / f"v{manifest.version}")
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_dir(directory)

    def _read_manifest(self, name: str, version: int) -> bytes | None:
        return self._read_file(name, version, MANIFEST_FILE)

    def _read_payload(self, name: str, version: int) -> bytes | None:
        return self._read_file(name, version, self.codec.payload_file)

    def _read_file(self, name: str, version: int, file: str) -> bytes | None:
        path = self._version_dir(name, version) / file
        with _os_errors(f"read {path}"), contextlib.suppress(FileNotFoundError):
            return path.read_bytes()
        return None

    def _compare_and_set(self, name: str, expected: int | None, new: int) -> None:
        with _os_errors(f"move the pointer of {name!r}"), self._locked(name) as directory:
            actual = _read_int(directory / "CURRENT")
            if actual != expected:
                raise PublishConflict(name, expected, actual, new)
            if new != BASE_VERSION and not (self._version_dir(name, new) / MANIFEST_FILE).is_file():
                raise self._not_found(name, new)
            _replace_durably(directory / "CURRENT", f"{new}\n".encode())

    def _delete_version(self, name: str, version: int) -> bool:
        with _os_errors(f"delete {name} v{version}"):
            with self._locked(name) as directory:
                source = self._version_dir(name, version)
                if _read_int(directory / "CURRENT") == version or not source.is_dir():
                    return False
                doomed = directory / f".tmp-del-v{version}-{uuid.uuid4().hex}"
                os.rename(source, doomed)
            shutil.rmtree(doomed, ignore_errors=True)  # leftovers go with the stale temps
        return True

    def _write_held(self, replica_id: str, report: bytes, ttl_s: float) -> None:
        held = self.root / HELD_DIR
        tmp = held / f".{replica_id}.tmp-{uuid.uuid4().hex}"
        with _os_errors(f"write {held / replica_id}.json"):
            held.mkdir(exist_ok=True)
            try:  # not fsynced: a report lost in a crash is replaced within an interval
                tmp.write_bytes(report)
                os.replace(tmp, held / f"{replica_id}.json")
            finally:
                tmp.unlink(missing_ok=True)

    def _read_held(self) -> list[bytes]:
        held, reports = self.root / HELD_DIR, []
        with _os_errors(f"read the reports under {held}"):
            if not held.is_dir():
                return []
            probe = held / ".now"
            probe.touch()  # the file server's clock, which dated the reports too
            now = probe.stat().st_mtime
            for path in held.glob("*.json"):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    modified, raw = path.stat().st_mtime, path.read_bytes()
                    if modified + decode_held(raw)[0] >= now:
                        reports.append(raw)
                    elif modified + _STALE_TEMP_S < now:
                        path.unlink()  # a replica gone for an hour
        return reports


class PointerPollSubscription(Subscription):
    """Notifications made by polling every pointer (`changed_pointers`) every `interval_s`.

    The notification of backends without a message channel (a shared filesystem); it reports
    the moves since it was created, coalescing several moves of one name into one event.
    """

    def __init__(self, store: VersionedStore[Any, Any], interval_s: float = 1.0) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._store = store
        self._interval_s = interval_s
        self._known: dict[str, int | None] = {n: store.current(n) for n in store.names()}
        self._pending: list[PointerEvent] = []
        self._closed = False

    def get(self, timeout_s: float) -> PointerEvent | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self._closed:
            if not self._pending:
                self._pending = self._store.changed_pointers(self._known)
                for event in self._pending:
                    self._known[event.name] = event.version
            if self._pending:
                return self._pending.pop(0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(self._interval_s, remaining))
        return None

    def close(self) -> None:
        self._closed = True
