"""``osd up``: the embedded stack starts, serves, restarts a redis-server and a trainer that die,
streams through HAProxy, and Ctrl-C leaves no process behind (the restarted ones included)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from serving.ingress import DIR_PREFIX, reap_stale
from tests.reliability.conftest import wait_for
from tests.serving.conftest import TOY, free_port

ROOT = Path(__file__).resolve().parents[2]


def process_table() -> list[list[str]]:
    """Every process as [pid, ppid, command line]. -ww: without it ps cuts command lines at the
    terminal's width (80 columns where there is no terminal, as in CI), which hid gcs_server's
    name at the end of a long path."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()[1:]]
    return [row + [""] * (3 - len(row)) for row in rows]


def processes_mentioning(*needles: str) -> list[str]:
    return [
        f"{pid} {args}"
        for pid, _parent, args in process_table()
        if any(n and n in args for n in needles) and "ps -ww" not in args
    ]


def descendants(pid: int, pattern: str) -> list[str]:
    """The command lines of process `pid`'s descendants (children, theirs, ...) that match
    `pattern`."""
    rows = process_table()
    family, found = {str(pid)}, []
    for _ in range(8):  # a few generations; pids are listed in no particular order
        family |= {child for child, parent, _ in rows if parent in family}
    for child, _parent, args in rows:
        if child in family and child != str(pid) and re.search(pattern, args):
            found.append(args)
    return found


def wait_for_start(process, output: list[str], timeout_s: float) -> None:
    """Waits until `osd up` has a redis-server and Ray's gcs_server or raylet below it (Ray is
    starting); fails at once, with its output, if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"osd up exited ({process.returncode}) during start:\n" + "".join(output[-40:])
            )
        if descendants(process.pid, r"redis-server") and descendants(
            process.pid, r"gcs_server|raylet"
        ):
            return
        time.sleep(0.1)
    raise AssertionError(
        f"no redis-server and Ray below osd up within {timeout_s} s; below it: "
        f"{descendants(process.pid, '.')}\n" + "".join(output[-40:])
    )


def assert_gone(find: Callable[[], list[str]], timeout_s: float = 30.0) -> None:
    """Polls until `find()` lists no process (children exit just after their parent does);
    fails with those left."""
    deadline = time.monotonic() + timeout_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def wait_for_line(process, pattern, timeout_s):
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError("".join(lines))


def loop_health(port: int) -> dict:
    """The replica's /health answer; a status saying why where no replica answered (nothing
    listens yet, or the ingress's own error page while none is up)."""
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    except httpx.HTTPError as exc:
        return {"status": f"unanswered: {exc}"}
    try:
        return response.json()
    except ValueError:
        return {"status": f"unanswered: HTTP {response.status_code}, not the replica's JSON"}


@pytest.mark.parametrize("when", ["while-serving", "during-start", "killed"])
def test_ctrl_c_leaves_no_process_behind(tmp_path, when):
    """Ctrl-C while serving (after the supervisor restarted Redis and the trainer) or during
    start-up stops everything (during start-up, without waiting for the replica's warm-up:
    the app never answers); SIGKILL of ``osd up`` itself takes its children with it, the
    restarted ones included (they were started from the supervisor's thread)."""
    port = free_port()
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "up",
            "--config",
            "configs/demo.yaml",
            *TOY,
            f"serve.port={port}",
            f"run_dir={run_dir}",
            "wandb.mode=disabled",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    session, trainer, output = "", "", []
    try:
        if when in ("while-serving", "killed"):
            lines = "".join(wait_for_line(process, r"Ctrl-C stops", timeout_s=240))
            session = re.search(r"ray session: (\S+)", lines).group(1)
            trainer = re.search(r"trainer pid: (\d+)", lines).group(1)
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
            assert models["data"][0]["id"] == "osd"
            # Ray Serve's HAProxy ingress (serve.ingress's default) is in front.
            haproxies = processes_mentioning(f"/{DIR_PREFIX}")
            assert haproxies and all("haproxy" in line for line in haproxies), haproxies
            # The stack restarts a redis-server and a trainer that die, and the loop mends.
            redis_pid = re.search(r"redis: \S+ \(pid (\d+)\)", lines).group(1)
            os.kill(int(trainer), signal.SIGKILL)
            os.kill(int(redis_pid), signal.SIGKILL)
            restarted = ""
            while not ("trainer restarted" in restarted and "redis-server restarted" in restarted):
                restarted += "".join(wait_for_line(process, r" restarted \(", timeout_s=60))
            assert "redis-server died (killed by signal 9)" in restarted, restarted
            assert "trainer died (killed by signal 9)" in restarted, restarted
            if when == "killed":
                process.kill()
                process.wait(timeout=30)
                try:
                    assert_gone(lambda: processes_mentioning(str(run_dir)))
                finally:  # Ray's own processes are not this test's subject
                    for line in processes_mentioning(session):
                        os.kill(int(line.split()[0]), signal.SIGKILL)
                # Its HAProxy outlives it (a child of a Ray actor): the next launch ends it.
                reap_stale()
                assert_gone(
                    lambda: [p for p in processes_mentioning(f"/{DIR_PREFIX}") if p in haproxies]
                )
                return
            last: list[dict] = [{}]

            def healthy() -> bool:
                last[0] = loop_health(port)
                return last[0].get("status") == "ok"

            try:
                wait_for(healthy, timeout_s=120, interval_s=1)
            except BaseException:
                print(f"last /health: {last[0]}")  # in the report: what stayed unmended
                raise
            # Streamed through HAProxy, after the outage: a record written while Redis was
            # killed leaves the log writer reporting its failed write until its next record.
            body = {
                "model": "osd",
                "prompt": "a b",
                "max_tokens": 3,
                "stream": True,
                "ignore_eos": True,
            }
            url = f"http://127.0.0.1:{port}/v1/completions"
            events = httpx.post(url, json=body, timeout=60).text.split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""] and '"finish_reason": "length"' in events[-3]
        # Keep reading its output: a full pipe would block the shutdown it prints about.
        threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
        if when == "during-start":  # once redis-server is up and Ray is starting
            wait_for_start(process, output, timeout_s=240)
        process.send_signal(signal.SIGINT)
        answered = []  # during start-up: the replica's warm-up is not waited for
        while when == "during-start" and process.poll() is None:
            answered.append(loop_health(port)["status"])
            time.sleep(0.2)
        replica = [status for status in answered if not status.startswith("unanswered")]
        assert replica == [], "".join(output[-40:])
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("no exit 120 s after Ctrl-C:\n" + "".join(output[-40:])) from None
    finally:
        if process.poll() is None:
            process.kill()

    def leftovers() -> list[str]:
        found = processes_mentioning(str(run_dir), session)
        if trainer:
            found += [
                p for p in processes_mentioning(" launcher.cli train") if p.split()[0] == trainer
            ]
        return found

    assert_gone(leftovers)
