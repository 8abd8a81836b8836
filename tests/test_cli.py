"""The ``osd`` command line from a directory that is not the checkout: configs resolve against
the current directory or name a built-in one, and a config that cannot be used is one line on
stderr with exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def osd(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )


@pytest.mark.parametrize(
    ("args", "file_text", "message"),
    [
        (["serve", "--config", "missing.yaml"], None, "missing.yaml: no such config file"),
        (["up", "--config", "bad.yaml"], "serve:\n  prot: 1\n", "bad.yaml: unknown key(s)"),
        (["demo", "--config", "bad.yaml"], "serve: [1, 2\n", "bad.yaml: while parsing"),
        (["up", "serve.host=0.0.0.0"], None, "serve.allow_unauthenticated"),
        (["serve", "spec.num_spec_tokens=0"], None, 'spec.num_spec_tokens must be "auto"'),
    ],
)
def test_a_config_that_cannot_be_used_is_one_line_and_status_2(tmp_path, args, file_text, message):
    if file_text is not None:
        (tmp_path / "bad.yaml").write_text(file_text)
    done = osd(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"osd {args[0]}: "), done.stderr
    assert message in lines[0]


def test_the_built_in_config_loads_from_any_directory(tmp_path):
    from osd.config import config_path, load_config

    path = config_path("demo")
    assert path.is_file() and path.parent.name == "configs"
    assert load_config("demo").model.target == "demo:target"
    assert load_config("demo") == load_config(str(path))
