"""`osd train --workers N` (or `trainer.workers: N`): N pool workers on this machine, each its
own `osd train` process with `trainer.pool=true`, restarted when it dies (not when it exits by
itself: `--exit-when-idle`, `--max-rounds`). SIGTERM / Ctrl-C stop them all."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from osd.process import die_with_parent_preexec

__all__ = ["run_members"]

_log = logging.getLogger("trainer")
_RESTART_DELAY_S = 1.0


def member_command(argv: Sequence[str], index: int) -> list[str]:
    """This process's `osd train` arguments for member `index` (without `--workers`)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        args.append(arg)
    return [
        sys.executable, "-m", "launcher.cli", "train", *args,
        "trainer.pool=true", "trainer.workers=1",
    ]  # fmt: skip


def run_members(argv: Sequence[str], workers: int, stop: threading.Event) -> int:
    """Runs `workers` members until `stop` or until they all exited by themselves.

    Returns:
        0 when every member ended with 0, else 1.
    """

    def start(index: int) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            member_command(argv, index),
            env={**os.environ, "OSD_TRAINER_POOL_MEMBER": str(index)},  # distinct ids
            preexec_fn=die_with_parent_preexec(),  # no orphaned worker if this one is killed
        )
        _log.info("pool worker %d started (pid %d)", index, process.pid)
        return process

    members = {i: start(i) for i in range(workers)}
    codes: dict[int, int] = {}
    while members and not stop.is_set():
        for index, process in list(members.items()):
            code = process.poll()
            if code is None:
                continue
            del members[index]
            if code == 0:
                codes[index] = 0
                continue
            _log.warning("pool worker %d (pid %d) died (%s); restarting", index, process.pid, code)
            time.sleep(_RESTART_DELAY_S)
            members[index] = start(index)
        stop.wait(0.2)
    for process in members.values():
        process.send_signal(signal.SIGTERM)
    for index, process in members.items():
        try:
            codes[index] = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            codes[index] = process.wait()
    return 0 if all(code == 0 for code in codes.values()) else 1
