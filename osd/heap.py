"""The startup heap kept out of Python's full garbage collections, as vLLM's engine does.

A full (generation 2) collection walks every container object the process holds, and the
thread that triggers it holds the GIL meanwhile. With torch, transformers, Ray and the models
loaded, one took 100-165 ms in the decode loop's thread on the demo pair (a step is 5 ms at 16
rows): twice in 1,500 steps of 16 sampled rows, and a step without drafting that long also
skewed the step costs the goodput controller compares drafting with. Objects alive once a
replica is built live as long as it does; :func:`freeze_startup_heap` moves them to the
permanent generation, so later collections walk only what serving allocated since. Call it
once per process, where that process is the replica's (each test builds replicas of its own
and drops them: what is frozen is never collected).
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collects once, then freezes every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
