"""A trainer killed with SIGKILL mid-training and started again resumes from the last published
version and its consumer group's position: it trains on exactly the records that were not
acknowledged, and on none that were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from osd.adapters import open_adapter_store
from osd.buffer.redis_server import connect
from tests.trainer.conftest import headroom_draft, push, toy_target, trainer_overrides

REPO = Path(__file__).resolve().parents[2]


def start_trainer(redis_url: str, overrides: list[str], *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "train",
            "--redis-url",
            redis_url,
            *extra,
            *overrides,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_version(store, proc: subprocess.Popen[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = store.current("general")
        if version is not None:
            return version
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no version published in {timeout_s} s:\n{proc.stderr.read()[-3000:]}")


def group_state(redis_url: str, stream: str, group: str) -> tuple[int, int]:
    """(pending, lag) of the consumer group."""
    client = connect(redis_url)
    try:
        info = next(g for g in client.xinfo_groups(stream) if g["name"] in (group, group.encode()))
        return int(info["pending"]), int(info["lag"])
    finally:
        client.close()


def lineage(store, version: int) -> list[int]:
    chain = [version]
    while (parent := store.manifest("general", chain[-1]).parent_version) is not None:
        chain.append(parent)
    return chain


def test_sigkilled_trainer_resumes_from_published_version_without_retraining_acked_records(
    tmp_path, redis_url, stream, records
):
    # The draft is loaded from a path, as in production; it has room to improve.
    toy_target().save_pretrained(tmp_path / "target")
    headroom_draft().save_pretrained(tmp_path / "draft")
    overrides = trainer_overrides(
        tmp_path,
        stream,
        batch_records=4,
        steps_per_round=5,
        min_records=4,
        min_holdout_records=4,
        publish_margin=0.0,
    )
    overrides += [f"model.target={tmp_path / 'target'}", f"model.draft={tmp_path / 'draft'}"]
    group = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.group="))
    push(redis_url, stream, records)
    store = open_adapter_store(tmp_path / "adapters")

    first = start_trainer(redis_url, overrides)
    killed_at = wait_for_version(store, first, timeout_s=60)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    first.stdout.close()
    first.stderr.close()
    version = store.current("general")
    assert version is not None and version >= killed_at
    pending, lag = group_state(redis_url, stream, group)
    unacked = pending + lag
    assert 0 < unacked < len(records), "the kill should land mid-training"

    second = start_trainer(redis_url, overrides, "--exit-when-idle", "1.0")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])["trainer_stats"]

    # Exactly the unacknowledged records came back (pending ones claimed, the rest read): no
    # acknowledged record was delivered again.
    assert stats["claimed"] == pending
    assert stats["read"] == lag
    # Each was judged first, then trained on once, or waits in the judge's window (pending).
    assert stats["held_out"] + stats["skipped"] == unacked
    still_held, lag = group_state(redis_url, stream, group)
    assert lag == 0 and 0 < still_held < unacked
    assert stats["trained_records"] + still_held == stats["held_out"]
    # It resumed from the version published before the kill, and built on it.
    assert f"general: resuming from v{version}" in err
    assert version in lineage(store, store.current("general"))
