"""The README's example is examples/quickstart.py, and it runs as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_the_quickstart_script():
    script = (ROOT / "examples" / "quickstart.py").read_text()
    body = script.split('"""', 2)[2].strip()
    assert body in (ROOT / "README.md").read_text()


def test_quickstart_runs_as_written():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "acceptance_rate" in done.stdout and "bytes" in done.stdout
