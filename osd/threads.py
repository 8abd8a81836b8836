"""CPU threads chosen on purpose: torch's intra-op thread count and OpenMP's wait policy.

Every osd process that runs torch on a CPU (the demo build, a replica's decode loop, the
trainer, the benchmarks) takes its intra-op thread count from :func:`choose_threads`: the cores
it may use, how many torch processes of osd share them, and an override if there is one.

Why (issue 17; one training step of the demo target on 2 cores): alone, 356 ms with 2 threads;
beside one busy process, 1,278 ms with 2 threads, 807 ms with ``OMP_WAIT_POLICY=PASSIVE`` and
631 ms with 1 thread. OpenMP's worker threads spin at every barrier while the thread they wait
for is descheduled in favour of the other process. Hence:

- threads: every usable core when alone; an even share of them when the local stack runs a
  replica and a trainer side by side (it tells its children so through
  ``OSD_TORCH_PROCESSES``, see :func:`child_env`);
- wait policy: ``PASSIVE`` (idle workers sleep) unless the user set one. OpenMP reads it when
  the library loads, at ``import torch``, so it has to be in the environment before that:
  :func:`ensure_wait_policy` sets it for the ``osd`` command and :func:`child_env` for child
  processes and Ray workers.

Overrides, strongest first: a count in config (``serve.torch_threads``,
``trainer.torch_threads``) or on a command line (``--threads``); ``OSD_TORCH_THREADS``; then the
automatic choice. A user's own ``OMP_WAIT_POLICY`` is kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "DEFAULT_WAIT_POLICY",
    "ENV_PROCESSES",
    "ENV_THREADS",
    "Role",
    "ThreadChoice",
    "apply_threads",
    "child_env",
    "choose_threads",
    "ensure_wait_policy",
    "quota_cores",
    "threads_applied",
    "threads_for",
    "usable_cores",
]

Role = Literal["build", "replica", "trainer", "bench"]
ENV_THREADS = "OSD_TORCH_THREADS"  # the user's count for every osd process
ENV_PROCESSES = "OSD_TORCH_PROCESSES"  # torch processes sharing the cores, set by the stack
ENV_WAIT_POLICY = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"
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
            else f"{ENV_WAIT_POLICY} unset (idle workers spin)"
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


def child_env(num_processes: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a child process (or Ray worker) that runs torch beside
    ``num_processes - 1`` other torch processes of osd; add them to the inherited ones.

    ``OMP_NUM_THREADS=1`` is the default of every thread in the child: the thread that does the
    work (decode loop, trainer) sets its own count from :func:`threads_for`, and helper threads
    stay single-threaded (a second parallel team beside the decode loop's halved its speed, see
    :mod:`osd.spec.loop`).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    env = os.environ if env is None else env
    out = {
        "OMP_NUM_THREADS": "1",
        ENV_WAIT_POLICY: env.get(ENV_WAIT_POLICY) or DEFAULT_WAIT_POLICY,
        "TOKENIZERS_PARALLELISM": "false",
        ENV_PROCESSES: str(num_processes),
    }
    if env.get(ENV_THREADS):
        out[ENV_THREADS] = env[ENV_THREADS]
    return out


def ensure_wait_policy(argv: Sequence[str] | None = None) -> bool:
    """Puts ``OMP_WAIT_POLICY=PASSIVE`` in this process's environment (children inherit it)
    unless the user set a policy.

    OpenMP reads the policy once, when torch loads. If torch is loaded already (importing the
    ``osd`` package loads it) and ``argv`` is given, the process re-executes itself once with
    that command line (``sys.orig_argv``) so the policy takes effect; it then finds it set.

    Returns:
        Whether the environment's policy is in effect in this process (False only when torch
        was loaded first and ``argv`` is None).
    """
    if os.environ.get(ENV_WAIT_POLICY):
        return True
    os.environ[ENV_WAIT_POLICY] = DEFAULT_WAIT_POLICY
    if "torch" not in sys.modules:
        return True
    if argv is None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(argv), dict(os.environ))
