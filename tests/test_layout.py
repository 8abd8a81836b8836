"""The dependency rules of the layout (README, "Layout"), checked over every module at once.

Every ``import`` and ``from ... import`` of every module of ``osd``, ``serving``, ``trainer`` and
``launcher`` is read from its source (function-level imports included), and:

* the pure core (``osd.spec``, ``osd.distill``, the record schema and its wire format, errors)
  imports no I/O backend (redis, ray, fastapi, subprocess, wandb ...) and none of osd's I/O
  modules, and importing all of it loads none of them either (checked in a fresh interpreter,
  so imports of imports count);
* the decode path (``osd.spec``) and the stores (``osd.buffer``, ``osd.adapters``) stay apart:
  the decode path imports only the record schema from the buffer;
* nothing in ``osd`` imports ``serving``, ``trainer`` or ``launcher``;
* ``serving`` and ``trainer`` never import each other, and nothing but ``launcher`` imports
  ``launcher`` (the app layer is the top);
* production code never imports the test helpers (``osd.testing``); ``toy:`` models come from
  ``osd.toy_models``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("osd", "serving", "trainer", "launcher")

# The pure core: computation on tensors and plain values; I/O lives at the edges.
CORE = (
    "osd.spec",
    "osd.distill",
    "osd.buffer.record",
    "osd.buffer.wire",
    "osd.errors",
    "osd.devices",
)
BACKENDS = frozenset(
    {"redis", "ray", "fastapi", "starlette", "uvicorn", "httpx", "subprocess", "wandb", "socket"}
)
IO_MODULES = frozenset(
    {
        "osd.buffer.reader",
        "osd.buffer.writer",
        "osd.buffer.redis_server",
        "osd.buffer.loop_status",
        "osd.buffer.stream_info",
        "osd.adapters",
        "osd.process",
        "launcher",
        "serving",
        "trainer",
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
    assert {"osd.spec.sampling", "osd.spec.step", "serving.runtime", "trainer.worker"} <= set(
        MODULES
    )
    assert {"launcher.cli", "osd.buffer.record", "osd.adapters.store"} <= set(MODULES)


def offenders(importers, imported) -> dict[str, list[str]]:
    """Modules under the prefixes `importers` that import a module under `imported`."""
    found = {
        module: sorted(i for i in names if within(i, imported))
        for module, names in MODULES.items()
        if within(module, importers)
    }
    return {module: names for module, names in found.items() if names}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, CORE)))
def test_the_pure_core_imports_no_io(module):
    imported = MODULES[module]
    assert not {i for i in imported if within(i, BACKENDS)}, "an I/O backend in the core"
    assert not {i for i in imported if within(i, IO_MODULES)}, "an I/O module in the core"


def test_importing_the_whole_core_loads_no_io_backend():
    """Imports of imports count: a fresh interpreter imports every core module, then lists which
    backends (and peft, which only the adapters need) got loaded on the way. The standard
    library's socket and subprocess are left out: torch itself loads them."""
    core = sorted(m for m in MODULES if within(m, CORE))
    heavy = sorted((BACKENDS - {"socket", "subprocess"}) | {"peft"})
    code = f"import importlib, sys\nfor m in {core!r}: importlib.import_module(m)\n" + (
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_record_schema_loads_without_torch():
    """The record and its wire format load in a bare interpreter (readers of the log need
    neither torch nor Redis): ``osd`` is a bare package there, so only their own imports count."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('osd'); pkg.__path__ = [{str(ROOT / 'osd')!r}]\n"
        "sys.modules['osd'] = pkg\n"
        "import osd.buffer.record, osd.buffer.wire\n"
        "print(sorted(m for m in ('redis', 'torch', 'ray') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_decode_path_and_the_stores_stay_apart():
    assert not offenders(("osd.spec",), ("osd.adapters", "osd.demo")), "the decode path"
    schema = ("osd.buffer.record", "osd.buffer.wire")
    beyond_schema = {
        module: [i for i in names if not within(i, schema)]
        for module, names in offenders(("osd.spec",), ("osd.buffer",)).items()
    }
    assert not {m: i for m, i in beyond_schema.items() if i}, "the decode path, beyond the schema"
    assert not offenders(("osd.buffer", "osd.adapters"), ("osd.spec", "osd.demo")), "the stores"
    assert not offenders(("osd.buffer",), ("osd.adapters",)), "the log buffer"


def test_osd_imports_neither_serving_trainer_nor_launcher():
    assert not offenders(("osd",), ("serving", "trainer", "launcher"))


def test_serving_and_trainer_never_import_each_other_and_nothing_imports_launcher():
    assert not offenders(("serving",), ("trainer", "launcher")), "serving"
    assert not offenders(("trainer",), ("serving", "launcher")), "trainer"


def test_production_code_never_imports_the_test_helpers():
    found = sorted(
        module
        for module, imported in MODULES.items()
        if module != "osd.testing" and any(within(i, ("osd.testing", "tests")) for i in imported)
    )
    assert not found
