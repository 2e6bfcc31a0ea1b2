"""The package layout: which part of swarm may import which, no import cycles, maps that list every module.

Reads the sources (``ast``), imports nothing. The rules are the ones each package's docstring
states (``swarm/__init__.py`` has the whole map); a module's group is its first name under
``swarm`` (``swarm.stage.server`` is in ``stage``), the shared core at the top is split by what
it may use.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "swarm"

# the shared core at the top of swarm/
# pure: the standard library and each other
CORE = {"errors", "ranges", "heal", "routing", "files", "addrs", "merkle", "repro", "flags", "frames"}
CORE_IO = {"config", "receipts", "wire", "listen", "mirror", "metrics", "openings", "proofs"}  # may use the transport
# group -> the groups it may import besides its own (every module may import the ``swarm`` package itself)
MAY_IMPORT = {
    "core": set(),
    "transport": {"core"},
    "core_io": {"core", "transport"},
    "kernels": {"core", "core_io"},
    "discovery": {"core", "core_io", "transport"},
    "weights": {"core", "core_io", "transport"},
    "model": {"core", "core_io", "kernels", "weights"},  # no networking of its own
    "auditor": {"core", "core_io", "transport", "kernels", "discovery", "weights", "model"},
    "stage": {"core", "core_io", "transport", "kernels", "discovery", "weights", "model", "auditor"},
    "coordinator": {"core", "core_io", "transport", "kernels", "discovery", "weights", "model", "auditor"},
    "serve": {"core", "core_io", "transport", "kernels", "discovery", "weights", "model", "auditor", "coordinator"},
    "cli": {"core", "core_io", "transport", "kernels", "discovery", "weights", "model", "auditor", "stage",
            "coordinator", "serve"},
    "main": {"cli"},
}


def group(module: str) -> str:
    """``swarm.stage.server`` -> ``stage``; the core at the top by what it may use."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    top = parts[1]
    if top in CORE:
        return "core"
    if top in CORE_IO:
        return "core_io"
    if top == "__main__":
        return "main"
    return top


@functools.lru_cache(maxsize=None)
def parse(source: str) -> ast.Module:
    """``ast.parse``, once per distinct source: the tests below read the same tree many times over.
    The tree is shared: callers only read it."""
    return ast.parse(source)


def read_tree(root: Path = ROOT) -> dict[str, str]:
    """``{module name: source}`` of every module under ``root`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


@functools.lru_cache(maxsize=None)
def swarm_targets(module: str, source: str, is_package: bool) -> tuple[str, ...]:
    """The absolute names of the swarm objects or modules ``module`` imports, at any depth of its code."""
    targets = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(pkg + ([base] if base else []))
            targets += [f"{base}.{a.name}" for a in node.names]
    return tuple(t for t in targets if t.split(".")[0] == "swarm")


def imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Every swarm module each module imports, at any depth of its code (a lazy import counts)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, source in modules.items():
        is_package = f"{module}.__init__" not in modules and any(m.startswith(module + ".") for m in modules)
        found = {resolve(t) for t in swarm_targets(module, source, is_package)}
        found.discard(None)
        found.discard(module)
        edges[module] = found
    return edges


def violations(modules: dict[str, str]) -> list[str]:
    """Imports that break a rule of ``MAY_IMPORT``, as ``"a imports b (group -> group)"``."""
    out = []
    for module, targets in sorted(imports(modules).items()):
        g = group(module)
        for t in sorted(targets):
            h = group(t)
            if h not in (g, "package") and h not in MAY_IMPORT.get(g, set()):
                out.append(f"{module} imports {t} ({g} -> {h})")
    return out


def cycles(modules: dict[str, str]) -> list[list[str]]:
    """Import cycles between modules (strongly connected components of more than one module, or a
    module importing itself), by Tarjan's algorithm."""
    edges = imports(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


def test_every_import_follows_the_layer_rules():
    modules = read_tree()
    assert {group(m) for m in modules} - {"package"} <= set(MAY_IMPORT), "a new top-level part needs a rule here"
    assert violations(modules) == []


def test_there_are_no_import_cycles():
    assert cycles(read_tree()) == []


@pytest.mark.parametrize("module, line, broken", [
    ("swarm.coordinator.generation", "from swarm.stage.server import StageServer",
     "swarm.coordinator.generation imports swarm.stage.server (coordinator -> stage)"),
    ("swarm.stage.server", "from swarm.coordinator.spec import SpecLoop",
     "swarm.stage.server imports swarm.coordinator.spec (stage -> coordinator)"),
    ("swarm.serve.app", "import swarm.cli.main", "swarm.serve.app imports swarm.cli.main (serve -> cli)"),
    ("swarm.heal", "    from swarm.transport import open_host",  # lazily, inside a function
     "swarm.heal imports swarm.transport (core -> transport)"),
    ("swarm.transport.host", "from swarm.wire import frame", "swarm.transport.host imports swarm.wire (transport -> core_io)"),
    ("swarm.model.block", "from swarm.discovery.dht import SwarmDHT",
     "swarm.model.block imports swarm.discovery.dht (model -> discovery)"),
])
def test_a_forbidden_import_is_caught(module, line, broken):
    modules = read_tree()
    if line.startswith(" "):
        line = f"def _added():\n{line}\n"
    modules[module] += "\n" + line + "\n"
    assert violations(modules) == [broken]


def test_an_added_cycle_is_caught():
    modules = read_tree()
    modules["swarm.transport.dataplane"] += "\nfrom swarm.transport.host import SwarmHost\n"
    found = cycles(modules)
    assert found and any({"swarm.transport.dataplane", "swarm.transport.host"} <= set(c) for c in found), found


def test_every_package_docstring_names_each_of_its_modules():
    """A package's map lists all its modules (and the top map all its parts), so a newcomer reading
    it sees the whole package."""
    modules = read_tree()
    missing = []
    for package in [m for m in modules if any(k.startswith(m + ".") for k in modules)]:
        doc = ast.get_docstring(parse(modules[package])) or ""
        depth = len(package.split(".")) + 1
        for child in sorted({".".join(k.split(".")[:depth]) for k in modules if k.startswith(package + ".")}):
            name = child.rsplit(".", 1)[1]
            if name.startswith("_") and name != "__main__":
                continue
            if f"``{name}``" not in doc and f"``{child}``" not in doc:
                missing.append(f"{package}: {name}")
    assert missing == []


@pytest.mark.parametrize("package", ["swarm.stage", "swarm.coordinator", "swarm.serve", "swarm.cli", "swarm.kernels",
                                     "swarm.discovery", "swarm.weights", "swarm.model"])
def test_importing_a_role_package_imports_nothing(package):
    """``import swarm.stage.acquire`` must not run the daemon's imports (torch) through ``swarm.stage``:
    a package's ``__init__`` is its map, not a re-export hub."""
    tree = parse(read_tree()[package])
    assert [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] == []


def test_the_longest_first_list_names_test_files_that_exist():
    from tests.conftest import LONGEST_FIRST, REPO

    assert [name for name in LONGEST_FIRST if not (REPO / "tests" / name).is_file()] == []


def lazy_light_imports(modules: dict[str, str]) -> list[str]:
    """Imports inside functions of the standard library or of the pure core (``CORE``): both are
    cheap and torch-free, so they belong at the module's top (a lazy import is kept for what is heavy
    or optional: torch, transformers, libp2p, the other swarm parts)."""
    import sys

    found = []
    for module, source in sorted(modules.items()):
        for fn in ast.walk(parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and not node.level:
                    name = node.module or ""
                elif isinstance(node, ast.Import):
                    name = node.names[0].name
                else:
                    continue
                parts = name.split(".")
                if parts[0] in sys.stdlib_module_names or (parts[0] == "swarm" and len(parts) > 1 and parts[1] in CORE):
                    found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_cheap_imports_sit_at_the_module_top():
    assert lazy_light_imports(read_tree()) == []


def test_a_lazy_cheap_import_is_caught():
    modules = {"swarm.x": "def f():\n    import json\n    from swarm.errors import ConfigError\n    import torch\n"}
    assert lazy_light_imports(modules) == ["swarm.x:2 import json", "swarm.x:3 from swarm.errors import ConfigError"]
