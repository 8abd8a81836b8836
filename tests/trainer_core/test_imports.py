"""The pure core imports no I/O backends: losses, acceptance and the store's core stay free of
Redis, Ray and peft until a backend or helper that needs them is used."""

from __future__ import annotations

import subprocess
import sys


def test_core_modules_import_no_redis_ray_or_peft():
    code = (
        "import sys, osd.losses, osd.acceptance, osd.adapter_manifest, osd.adapter_store\n"
        "print(sorted(m for m in ('redis', 'ray', 'peft') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
