"""The dependency rules of the layout (README, "Layout"), checked over every module at once.

Every ``import`` and ``from ... import`` of every module of ``osd``, ``serving`` and ``trainer``
is read from its source (function-level imports included), and:

* the pure core (sampling, verification, the decode step, losses, acceptance estimates, the
  record schema, grammars) imports no I/O backend (redis, ray, fastapi, subprocess, wandb ...)
  and none of osd's I/O modules;
* nothing in ``osd`` imports ``serving`` or ``trainer`` (the CLI entry point loads them by
  name, the one exception);
* ``serving`` and ``trainer`` never import each other;
* production code never imports the test helpers (``osd.testing``); ``toy:`` models come from
  ``osd.toy_models``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("osd", "serving", "trainer")

# The pure core: computation on tensors and plain values; I/O lives at the edges.
CORE = (
    "osd.sampling",
    "osd.prefix_history",
    "osd.verification",
    "osd.losses",
    "osd.acceptance",
    "osd.record",
    "osd.record_wire",
    "osd.generation",
    "osd.grammar",
    "osd.errors",
    "osd.request_checks",
    "osd.devices",
    "osd.spec",
)
BACKENDS = frozenset(
    {"redis", "ray", "fastapi", "starlette", "uvicorn", "httpx", "subprocess", "wandb", "socket"}
)
IO_MODULES = frozenset(
    {
        "osd.log_reader",
        "osd.log_writer",
        "osd.redis_server",
        "osd.loop_status",
        "osd.stream_info",
        "osd.adapter_store_redis",
        "osd.adapter_store_dir",
        "osd.process",
        "osd.cli",
    }
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {
    module_name(path): imports_of(path)
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
}


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_every_package_is_read():
    assert {"osd.sampling", "osd.spec.step", "serving.runtime", "trainer.worker"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, CORE)))
def test_the_pure_core_imports_no_io(module):
    imported = MODULES[module]
    assert not {i for i in imported if within(i, BACKENDS)}, "an I/O backend in the core"
    assert not {i for i in imported if within(i, IO_MODULES)}, "an I/O module in the core"


def test_osd_imports_neither_serving_nor_trainer():
    offenders = {
        module: sorted(i for i in imported if within(i, ("serving", "trainer")))
        for module, imported in MODULES.items()
        if within(module, ("osd",)) and module != "osd.cli"
    }
    assert not {m: i for m, i in offenders.items() if i}


def test_serving_and_trainer_never_import_each_other():
    for side, other in (("serving", "trainer"), ("trainer", "serving")):
        offenders = {
            module: sorted(i for i in imported if within(i, (other,)))
            for module, imported in MODULES.items()
            if within(module, (side,))
        }
        assert not {m: i for m, i in offenders.items() if i}, side


def test_production_code_never_imports_the_test_helpers():
    offenders = sorted(
        module
        for module, imported in MODULES.items()
        if module != "osd.testing" and any(within(i, ("osd.testing", "tests")) for i in imported)
    )
    assert not offenders
