"""The stack's supervisor restarts real child processes that die, and gives up on a crash loop."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from launcher.supervisor import Supervised, Supervisor


class Child:
    """A real child process started from ``args``, restartable."""

    def __init__(self, *args: str) -> None:
        self.args, self.starts = list(args), 0
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(self.args)
        self.starts += 1

    def exit_status(self) -> str | None:
        assert self.process is not None
        code = self.process.poll()
        return None if code is None else f"exit code {code}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def supervised(name: str, child: Child) -> Supervised:
    return Supervised(name, child.exit_status, child.start, hint=f"{name}.log")


def test_a_killed_child_is_restarted_after_a_backoff_and_counted():
    child, said = Child("sleep", "60"), []
    supervisor = Supervisor([supervised("sleeper", child)], say=said.append)
    try:
        supervisor.check(now=0.0)
        assert supervisor.status()["sleeper"] == {
            "state": "running",
            "restarts": 0,
            "last_exit": "",
        }
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait()
        supervisor.check(now=10.0)  # noticed; restarted one backoff (1 s) later
        assert supervisor.status()["sleeper"]["state"] == "restarting"
        assert child.starts == 1
        supervisor.check(now=11.0)
        status = supervisor.status()["sleeper"]
        assert status == {"state": "running", "restarts": 1, "last_exit": "exit code -9"}
        assert child.starts == 2 and child.process.poll() is None
        assert said == [
            "[osd] sleeper died (exit code -9); restarting it in 1 s",
            "[osd] sleeper restarted (restart 1)",
        ]
    finally:
        supervisor.close()
        child.stop()


def test_a_child_that_keeps_dying_is_reported_and_left_alone():
    child, said = Child("false"), []
    supervisor = Supervisor(
        [supervised("crasher", child)], max_restarts=3, window_s=300.0, say=said.append
    )
    now = 0.0
    for _ in range(40):  # 40 s of checks: enough for every backoff (1, 2, 4 s)
        child.process.wait()
        supervisor.check(now=now)
        now += 1.0
    status = supervisor.status()["crasher"]
    assert status["state"] == "failed" and status["restarts"] == 3
    assert child.starts == 4  # the first start and three restarts, then no more
    assert said[-1] == (
        "[osd] crasher died 4 times in 300 s (last: exit code 1); not restarting it: see "
        "crasher.log"
    )


def test_the_thread_restarts_what_dies_until_closed():
    child = Child("sleep", "60")
    supervisor = Supervisor([supervised("sleeper", child)], interval_s=0.05, say=lambda _: None)
    supervisor.start()
    try:
        child.process.kill()
        deadline = 100
        while supervisor.status()["sleeper"]["restarts"] < 1 and deadline:
            time.sleep(0.1)
            deadline -= 1
        assert supervisor.status()["sleeper"]["restarts"] == 1
    finally:
        supervisor.close()
    child.stop()
    restarted = child.starts
    supervisor.check()  # closed: it restarts nothing any more
    assert child.starts == restarted
