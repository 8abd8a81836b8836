"""A miniature demo pair built once per session through the real build path (scale "tiny")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from osd.demo import DemoModelPaths, build_demo_models


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="session")
def tiny_paths(tiny_cache: Path) -> DemoModelPaths:
    """Built once; tests must not modify it (copy it with ``copy_cache`` first)."""
    return build_demo_models(tiny_cache, "tiny", progress=False, num_threads=1)


@pytest.fixture
def copy_cache(tiny_paths: DemoModelPaths, tmp_path: Path):
    """Returns a function that copies the built tiny cache to a fresh cache directory."""

    def copy() -> Path:
        cache = tmp_path / "cache"
        shutil.copytree(tiny_paths.root, cache / tiny_paths.root.name)
        return cache

    return copy
