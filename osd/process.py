"""Child processes that do not outlive their parent, even when the parent is SIGKILLed."""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["die_with_parent", "die_with_parent_preexec"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: on Linux the child gets SIGTERM when the thread
    that started it exits (start children from the main thread). A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent_preexec() -> Callable[[], None] | None:
    """:func:`die_with_parent` when called on the main thread, else None.

    Linux sends the parent-death signal when the *thread* that forked exits, so a child started
    from a short-lived thread (a test's chaos thread restarting Redis) must not ask for it.
    """
    return die_with_parent if threading.current_thread() is threading.main_thread() else None
