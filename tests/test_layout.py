"""The dependency rules of the layout (README, "Layout"), checked over every module at once.

Every ``import`` and ``from ... import`` of every module of ``osd``, ``serving``, ``trainer`` and
``launcher`` is read from its source (function-level imports included), and:

* the pure core (``osd.decode``, ``osd.distill``, the record schema and its wire format, errors)
  imports no I/O backend (redis, ray, fastapi, subprocess, wandb ...) and none of osd's I/O
  modules, and importing all of it loads none of them either (checked in a fresh interpreter,
  so imports of imports count);
* the decode core (``osd.decode``) and the stores (``osd.buffer``, ``osd.versions``,
  ``osd.adapters``, ``osd.routing``) stay apart: the decode core imports none of them, and they
  import only its names and its log type;
* the versioned store (``osd.versions``) knows no artefact: it imports neither the adapters nor
  the routing model, nor torch;
* no import cycle, between files or between folders;
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
    "osd.decode",
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
        "osd.versions",
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
    assert {"osd.decode.sampling", "osd.decode.step", "serving.runtime", "trainer.worker"} <= set(
        MODULES
    )
    assert {"launcher.cli", "osd.buffer.record", "osd.versions.store"} <= set(MODULES)


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


def test_the_decode_core_and_the_stores_stay_apart():
    """The decode core (``osd.decode``) imports none of the stores, the demo or the config; the
    stores import from it only the names it owns (``osd.decode.methods``) and, the record, the
    type of a finished generation's log it is built from."""
    stores = ("osd.adapters", "osd.buffer", "osd.routing", "osd.versions")
    assert not offenders(("osd.decode",), (*stores, "osd.demo", "osd.config")), "the decode core"
    allowed = ("osd.decode.methods", "osd.decode.generation")
    beyond = {
        module: [i for i in names if not within(i, allowed)]
        for module, names in offenders(stores, ("osd.decode",)).items()
    }
    assert not {m: i for m, i in beyond.items() if i}, "the stores, beyond the decode's names"
    assert not offenders(stores, ("osd.demo",)), "the stores"
    assert not offenders(("osd.buffer",), ("osd.adapters", "osd.versions")), "the log buffer"


def test_the_versioned_store_knows_no_artefact():
    """``osd.versions`` keeps versions of anything through a codec: the adapters and the
    routing model depend on it, never the other way, and it needs no torch."""
    artefacts = ("osd.adapters", "osd.routing", "torch", "safetensors", "peft")
    assert not offenders(("osd.versions",), artefacts), "osd.versions"


def _own_modules(names: set[str]) -> set[str]:
    """The modules of ours among ``names`` (``from a.b import c`` names ``a.b`` too)."""
    return {n for n in names if n in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (a path back to its start), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycle_between_files():
    """No module imports itself through others (``TYPE_CHECKING`` and function-level imports
    count: a cycle there is still two files that cannot be read apart)."""
    graph = {m: _own_modules(names) - {m} for m, names in MODULES.items()}
    assert _cycle(graph) == []


def test_no_import_cycle_between_folders():
    """The folders (``osd/decode``, ``osd/buffer``, ... and the app layer's packages) import each
    other along a DAG; ``osd``'s own top-level modules are shared helpers, covered file by file."""

    def folder(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "osd":
            return parts[0]
        is_package = (ROOT / Path(*parts)).is_dir()
        return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and is_package) else None

    graph: dict[str, set[str]] = {}
    for module, names in MODULES.items():
        here = folder(module)
        for other in _own_modules(names):
            there = folder(other)
            if here and there and there != here:
                graph.setdefault(here, set()).add(there)
    assert "osd.decode" in graph["osd.buffer"] and "osd.decode" in graph["serving"]
    assert _cycle(graph) == []


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
