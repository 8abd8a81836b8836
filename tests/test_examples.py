"""The README's examples are examples/*.py, and they run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["quickstart", "batched"])
def test_readme_examples_are_the_scripts(name):
    script = (ROOT / "examples" / f"{name}.py").read_text()
    body = script.split('"""', 2)[2].strip()
    assert body in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("quickstart", ["acceptance_rate", "bytes"]), ("batched", ["mean batch"])],
)
def test_examples_run_as_written(name, expected):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert all(word in done.stdout for word in expected), done.stdout
