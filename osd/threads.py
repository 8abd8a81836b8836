"""CPU threads chosen on purpose: torch's intra-op thread count and OpenMP's wait policy.

Every osd process that runs torch on a CPU (the demo build, a replica's decode loop, the
trainer, the benchmarks) takes its intra-op thread count from :func:`choose_threads`: the cores
it may use, how many torch processes of osd share them, and an override if there is one.

Why (issue 17; one training step of the demo target on 2 cores, bench/bench_threads.py and
docs/demo_models.md): alone, 2 threads take 0.34-0.37 s and 1 thread 0.61-0.64 s; beside one
busy torch process 2 threads took 1.1 s in one run and 14.9 s in another (OpenMP's workers
spin at every barrier while the thread they wait for is descheduled), 1 thread 0.90-0.95 s.
Hence:

- threads: every usable core when alone; an even share of them when the local stack runs a
  replica and a trainer side by side (it tells its children so through
  ``OSD_TORCH_PROCESSES``, see :func:`child_env`); a replica leaves one core of its share to
  its own HTTP side, as vLLM binds its engine to one core of two and its API server to the
  other (2 cores, through HTTP, target alone at one client: 386-393 tok/s on one thread
  against 344-348 on two: the event loop's wake-ups no longer stall an OpenMP team;
  ``docs/benchmarks.md``);
- a long CPU training loop (the demo build) measures whether fewer threads would be faster
  now and switches (:class:`ThreadTuner`), since a busy neighbour comes and goes;
- a replica's GIL switch interval is short (``serve.gil_switch_interval_ms``, 0.5 ms against
  Python's 5; :func:`set_switch_interval`): its decode thread shares the GIL with the HTTP
  event loop, and waited up to the whole interval for it whenever the loop took it during a
  kernel;
- the wait policy stays OpenMP's default: ``OMP_WAIT_POLICY=PASSIVE`` avoided the worst case
  beside a busy process but cost 25 % per training step alone and made a decode step 3-4x
  slower (4.7 -> 12.3 ms; 3.3 -> 13.1 ms). A user's own ``OMP_WAIT_POLICY`` is passed on to
  the stack's children.

Overrides, strongest first: a count in config (``serve.torch_threads``,
``trainer.torch_threads``) or on a command line (``--threads``); ``OSD_TORCH_THREADS``; then the
automatic choice.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "ENV_PROCESSES",
    "ENV_THREADS",
    "Role",
    "ThreadChoice",
    "ThreadTuner",
    "apply_threads",
    "child_env",
    "choose_threads",
    "quota_cores",
    "set_switch_interval",
    "threads_applied",
    "threads_for",
    "single_threaded_torch",
    "torch_single_threaded",
    "usable_cores",
]

Role = Literal["build", "replica", "trainer", "bench"]
ENV_THREADS = "OSD_TORCH_THREADS"  # the user's count for every osd process
ENV_PROCESSES = "OSD_TORCH_PROCESSES"  # torch processes sharing the cores, set by the stack
ENV_WAIT_POLICY = "OMP_WAIT_POLICY"
# Where a role's explicit count comes from, for messages.
_REQUESTED_BY = {
    "build": "--threads",
    "replica": "serve.torch_threads",
    "trainer": "trainer.torch_threads",
    "bench": "--threads",
}


@dataclass(frozen=True)
class ThreadChoice:
    """What a process runs torch with, and why.

    Attributes:
        role: who runs torch.
        num_threads: torch intra-op threads.
        num_cores: cores the process may use.
        num_processes: torch processes of osd sharing those cores, itself included.
        source: what decided the count: the override's name (``"trainer.torch_threads"``,
            ``"OSD_TORCH_THREADS"``, ...) or ``"auto"``.
        wait_policy: ``OMP_WAIT_POLICY`` in the environment; empty when unset.
    """

    role: Role
    num_threads: int
    num_cores: int
    num_processes: int
    source: str
    wait_policy: str

    def describe(self) -> str:
        """One line for a log, e.g. ``torch (trainer): 1 thread of 2 usable cores (shared by
        2 torch processes), OMP_WAIT_POLICY=PASSIVE``."""
        threads = f"{self.num_threads} thread{'s' * (self.num_threads != 1)}"
        cores = f"{self.num_cores} usable core{'s' * (self.num_cores != 1)}"
        if self.source != "auto":
            why = f"set by {self.source}"
        elif self.num_processes > 1:
            why = f"shared by {self.num_processes} torch processes"
        else:
            why = "alone"
        policy = (
            f"{ENV_WAIT_POLICY}={self.wait_policy}"
            if self.wait_policy
            else f"{ENV_WAIT_POLICY} unset (OpenMP's default)"
        )
        return f"torch ({self.role}): {threads} of {cores} ({why}), {policy}"


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return value


def choose_threads(
    role: Role,
    requested: int = 0,
    *,
    num_cores: int,
    num_processes: int = 1,
    env: Mapping[str, str] | None = None,
    requested_by: str = "",
) -> ThreadChoice:
    """Decides a process's torch thread count; pure (see :func:`threads_for` for this process).

    Args:
        role: who asks (only reported).
        requested: an explicit count (config or command line); 0: not given.
        num_cores: cores the process may use (:func:`usable_cores`).
        num_processes: torch processes of osd sharing those cores, the asker included.
        env: environment variables (``OSD_TORCH_THREADS``, ``OMP_WAIT_POLICY``).
        requested_by: the name of ``requested`` in messages; default: the role's config key
            (``"serve.torch_threads"``, ``"trainer.torch_threads"``) or ``"--threads"``.

    Raises:
        ValueError: an unknown role, a negative count, or a malformed ``OSD_TORCH_THREADS``.
    """
    if role not in get_args(Role):
        raise ValueError(f"role must be one of {get_args(Role)}, got {role!r}")
    requested_by = requested_by or _REQUESTED_BY[role]
    if requested < 0:
        raise ValueError(f"{requested_by} must be >= 0 (0: chosen), got {requested}")
    if num_cores < 1 or num_processes < 1:
        raise ValueError(f"num_cores and num_processes must be >= 1: {num_cores}, {num_processes}")
    env = env or {}
    if requested:
        count, source = requested, requested_by
    elif env.get(ENV_THREADS):
        count, source = _positive_int(ENV_THREADS, env[ENV_THREADS]), ENV_THREADS
    else:
        # Alone, every core wins; beside a busy process, fewer threads win (see the module doc).
        count, source = max(1, num_cores // num_processes), "auto"
        if role == "replica":  # its own HTTP side (event loop, tokenizing) keeps a core
            count = max(1, count - 1)
    return ThreadChoice(role, count, num_cores, num_processes, source, env.get(ENV_WAIT_POLICY, ""))


def quota_cores(cpu_max: str) -> int | None:
    """Cores a cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) allows,
    rounded up; None when unlimited or unreadable."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def _cgroup_quota_cores() -> int | None:
    """The CPU quota of this process's cgroup (e.g. ``docker run --cpus``), if any."""
    try:
        with open("/proc/self/cgroup") as f:
            paths = [line.split("::", 1)[1].strip() for line in f if line.startswith("0::")]
        with open(f"/sys/fs/cgroup{paths[0] if paths else ''}/cpu.max") as f:
            return quota_cores(f.read())
    except (OSError, IndexError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, within its cgroup's quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota_cores()
    return max(1, min(cores, quota) if quota else cores)


def threads_for(role: Role, requested: int = 0, *, requested_by: str = "") -> ThreadChoice:
    """:func:`choose_threads` for this process: its usable cores and environment."""
    env = os.environ
    processes = _positive_int(ENV_PROCESSES, env[ENV_PROCESSES]) if env.get(ENV_PROCESSES) else 1
    return choose_threads(
        role,
        requested,
        num_cores=usable_cores(),
        num_processes=processes,
        env=env,
        requested_by=requested_by,
    )


def apply_threads(role: Role, requested: int = 0, *, requested_by: str = "") -> ThreadChoice:
    """Sets the calling thread's torch thread count from :func:`threads_for`; returns the
    choice so the caller can report it (:meth:`ThreadChoice.describe`)."""
    import torch

    choice = threads_for(role, requested, requested_by=requested_by)
    torch.set_num_threads(choice.num_threads)
    return choice


@contextlib.contextmanager
def threads_applied(
    role: Role, requested: int = 0, *, requested_by: str = ""
) -> Iterator[ThreadChoice]:
    """:func:`apply_threads` for the block; the calling thread's previous count comes back
    after it (a library call must not leave its caller's threads changed)."""
    import torch

    previous = torch.get_num_threads()
    try:
        yield apply_threads(role, requested, requested_by=requested_by)
    finally:
        torch.set_num_threads(previous)


def single_threaded_torch() -> None:
    """Makes torch run single-threaded in the calling thread for good (helper threads that load
    adapters or tensors beside the decode loop, as a thread pool's initializer: a thread that
    runs torch in parallel keeps an OpenMP team beside the loop's; see
    :func:`torch_single_threaded`)."""
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def torch_single_threaded() -> Iterator[None]:
    """Runs torch single-threaded in the calling thread for the block, then restores its count.

    For one-off model work outside the decode loop (load checks, sizing forwards): a thread
    that once ran torch in parallel keeps an OpenMP team of its own, and beside it the decode
    loop's forwards ran about 2x slower (measured: the target alone at 16 rows, 1,074-1,364
    tok/s before a 2-thread load check in the constructing thread, 490-617 after).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def set_switch_interval(milliseconds: float) -> float:
    """Sets this process's GIL switch interval (``sys.setswitchinterval``) to ``milliseconds``
    (0: leaves it); returns the interval in effect, in seconds. Process-wide: call it where a
    process is the replica's own (its Ray Serve actor), not in a library."""
    if milliseconds > 0:
        sys.setswitchinterval(milliseconds / 1000)
    return sys.getswitchinterval()


def child_env(num_processes: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a child process (or Ray worker) that runs torch beside
    ``num_processes - 1`` other torch processes of osd; add them to the inherited ones.

    ``OMP_NUM_THREADS=1`` is the default of every thread in the child: the thread that does the
    work (decode loop, trainer) sets its own count from :func:`threads_for`, and helper threads
    stay single-threaded (a second parallel team beside the decode loop's halved its speed, see
    :mod:`osd.decode.loop`).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    env = os.environ if env is None else env
    out = {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        ENV_PROCESSES: str(num_processes),
    }
    for name in (ENV_THREADS, ENV_WAIT_POLICY):  # the user's, passed on
        if env.get(name):
            out[name] = env[name]
    return out


class ThreadTuner:
    """Keeps a CPU training loop on the faster of two thread counts, by measuring.

    Measured on 2 cores (demo target, one training step): alone, 2 threads take 0.34-0.37 s
    and 1 thread 0.61-0.64 s; beside one busy torch process, 2 threads took 1.1 s in one run
    and 14.9 s in another (OpenMP's workers spinning at barriers while the other process holds
    a core), 1 thread 0.90-0.95 s. Which count wins changes while a build runs, as other work
    comes and goes, so the loop measures instead of guessing: every ``probe_every`` steps it
    runs ``probe_steps`` steps on the other count and keeps it if those were faster than the
    recent steps by ``margin``. A probe that loses doubles the wait before the next, up to
    ``max_every`` steps; a switch resets it. A change of machine is not waited for: when
    ``react_after`` steps in a row take more than ``react_factor`` times the median of the
    last ``window`` steps on the current count (a neighbour started), or less than that median
    divided by it (a neighbour left), the next step probes. Beside a neighbour that started
    mid-build, 2 threads went from ~1.1 s to ~10 s a step and the tuner, waiting out its
    doubled probe interval, stayed there for minutes (``docs/demo_models.md``).

    Call :meth:`before_step` before each step and :meth:`after_step` with its seconds.

    Args:
        counts: (chosen, other): the loop starts on the first.
        set_threads: applies a count (``torch.set_num_threads``).
        on_switch: told ``(old, new, old_seconds, new_seconds)`` when the count changes.
    """

    def __init__(
        self,
        counts: tuple[int, int],
        *,
        set_threads: Callable[[int], None],
        on_switch: Callable[[int, int, float, float], None] | None = None,
        probe_every: int = 64,
        probe_steps: int = 2,
        max_every: int = 1024,
        margin: float = 0.1,
        react_factor: float = 2.0,
        react_after: int = 2,
        window: int = 16,
    ) -> None:
        if min(counts) < 1 or probe_every < 1 or probe_steps < 1 or not 0 <= margin < 1:
            raise ValueError(
                "need counts >= 1, probe_every >= 1, probe_steps >= 1, margin in [0,1)"
            )
        self.current, self.other = counts
        self.probe_every, self.probe_steps = probe_every, probe_steps
        self.max_every, self.margin = max(max_every, probe_every), margin
        self._set, self._on_switch = set_threads, on_switch
        self._wait = probe_every
        self._since_probe = 0
        self._recent: float | None = None  # moving average of the current count's steps
        self._probe: list[float] = []
        self._probing = False
        self._applied = 0
        self.react_factor, self.react_after = react_factor, react_after
        self._window: deque[float] = deque(maxlen=window)  # the current count's recent steps
        self._odd = 0  # steps in a row far from the window's median

    @property
    def threads(self) -> int:
        """The count the next step runs with."""
        return self.other if self._probing else self.current

    def before_step(self) -> None:
        if self.threads != self._applied:
            self._set(self.threads)
            self._applied = self.threads

    def after_step(self, seconds: float) -> None:
        if self.current == self.other:
            return
        if self._probing:
            self._probe.append(seconds)
            if len(self._probe) >= self.probe_steps:
                self._end_probe()
            return
        recent = self._recent
        self._recent = seconds if recent is None else recent + 0.25 * (seconds - recent)
        self._since_probe += 1
        if self._changed(seconds):  # the machine changed under the loop: measure again now
            self._wait, self._recent = self.probe_every, seconds
            self._window.clear()  # the new regime gets a median of its own
        self._window.append(seconds)
        if self._since_probe >= self._wait or self._odd >= self.react_after:
            self._probing, self._probe, self._odd = True, [], 0

    def _changed(self, seconds: float) -> bool:
        """Counts steps in a row far from the recent median; True on the step that makes
        ``react_after`` of them."""
        if len(self._window) < 4:
            return False
        median = statistics.median(self._window)
        far = seconds > median * self.react_factor or seconds * self.react_factor < median
        self._odd = self._odd + 1 if far else 0
        return self._odd == self.react_after

    def _end_probe(self) -> None:
        probe = sum(self._probe) / len(self._probe)
        recent = self._recent if self._recent is not None else probe
        self._probing, self._since_probe = False, 0
        if probe < recent * (1 - self.margin):
            old, self.current, self.other = self.current, self.other, self.current
            self._recent, self._wait = probe, self.probe_every
            self._window.clear()  # another count: its own median
            if self._on_switch is not None:
                self._on_switch(old, self.current, recent, probe)
        else:
            self._wait = min(self.max_every, 2 * self._wait)
