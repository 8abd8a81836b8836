"""osd: online speculative decoding.

Lossless speculative decoding (token, block and SpecTr verification) over Hugging Face models,
with drafts distilled online from the target's logged distributions. See README.md.

The names below load on first use: importing ``osd`` (or ``launcher.cli``) does not load torch, so
the command line can set ``OMP_WAIT_POLICY`` before OpenMP reads it (osd.threads).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from osd.decode.engine import SpeculativeDecoder
    from osd.decode.generation import GenerationLog, GenerationResult, GenerationStats, StreamChunk
    from osd.decode.sampling import SamplingParams

_HOMES = {
    "SpeculativeDecoder": "osd.decode.engine",
    "GenerationLog": "osd.decode.generation",
    "GenerationResult": "osd.decode.generation",
    "GenerationStats": "osd.decode.generation",
    "StreamChunk": "osd.decode.generation",
    "SamplingParams": "osd.decode.sampling",
}

__all__ = [
    "GenerationLog",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamChunk",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'osd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
