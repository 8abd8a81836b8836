"""Where osd keeps files it makes for itself: ``$OSD_CACHE_DIR``, else ``~/.cache/osd``
(the demo pair, inductor's compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["osd_cache_dir"]


def osd_cache_dir() -> Path:
    """``$OSD_CACHE_DIR`` if set, else ``~/.cache/osd``."""
    base = os.environ.get("OSD_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "osd"
