"""Child processes that do not outlive their parent, even when the parent is SIGKILLed."""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["die_with_parent", "die_with_parent_preexec", "mark_long_lived"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: on Linux the child gets SIGTERM when the thread
    that started it exits (start children from the main thread). A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_LONG_LIVED: set[int] = set()  # idents of threads that end only with the process


def mark_long_lived() -> None:
    """Declares that the calling thread ends only when the process does (it never returns
    from its target), so children it starts may ask to die with it (a supervisor)."""
    _LONG_LIVED.add(threading.get_ident())


def die_with_parent_preexec() -> Callable[[], None] | None:
    """:func:`die_with_parent` when called on the main thread or a :func:`mark_long_lived`
    one, else None.

    Linux sends the parent-death signal when the *thread* that forked exits, so a child started
    from a short-lived thread (a test's chaos thread restarting Redis) must not ask for it.
    """
    current = threading.current_thread()
    if current is threading.main_thread() or threading.get_ident() in _LONG_LIVED:
        return die_with_parent
    return None
