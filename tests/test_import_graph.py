"""Imports flow one way: no cycle among the modules of packages/*/src, counting every import
statement (module-level, inside functions, and under TYPE_CHECKING; `from pkg import x` counts
as importing pkg, and pkg.x when that is a module); and miles-core imports nothing that needs
torch or transformers. Read from the source with `ast`, so nothing is imported here."""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src"))


def _modules() -> dict[str, Path]:
    """Every module under packages/*/src, by dotted name (packages by their __init__)."""
    found: dict[str, Path] = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, type_checking: bool = True) -> Iterator[tuple[str, int]]:
    """(imported dotted name, line) for every import statement anywhere in the module (without
    those under `if TYPE_CHECKING:` unless `type_checking`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                skip |= {id(n) for child in node.body for n in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield base, node.lineno
            for alias in node.names:  # `from pkg import submodule`
                yield f"{base}.{alias.name}", node.lineno


def _edges() -> dict[str, dict[str, int]]:
    """module -> {miles module it imports: line}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        targets: dict[str, int] = {}
        for target, line in _imports(name, path):
            if target in MODULES and target != name:
                targets.setdefault(target, line)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_walk_sees_every_package_and_its_imports() -> None:
    graph = _edges()
    assert {"miles.core.cli", "miles.torch.plugin", "miles.recipes.twins"} <= graph.keys()
    # Function-level and TYPE_CHECKING imports count too.
    assert "miles.runtime.runner" in graph["miles.runtime.commands"]  # inside the `run` command
    assert "miles.core.contracts.protocols" in graph["miles.core.contracts.hookspecs"]


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _loop(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One cycle through the component's first module, as `a (line n) -> b ... -> a`."""
    inside, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        v = frontier.pop(0)
        for w in graph[v]:
            if w == start:
                path = [*paths[v], start]
                return (
                    " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(path))
                    + f" -> {start}"
                )
            if w in inside and w not in paths:
                paths[w] = [*paths[v], w]
                frontier.append(w)
    return ", ".join(component)


def test_no_import_cycles() -> None:
    graph = _edges()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_loop(graph, c) for c in cycles)


FORBIDDEN_IN_CORE = ("torch", "transformers", "safetensors", "tokenizers", "matplotlib")


# The contracts (miles-core) and the runtime (miles-runtime): the torch-free part of Miles.
CORE_AND_RUNTIME = ("miles.core", "miles.runtime")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(CORE_AND_RUNTIME)))
def test_core_needs_no_torch_or_transformers(name: str) -> None:
    """At run time: tensors may appear in the contracts' annotations (under TYPE_CHECKING)."""
    bad = [
        (target, line)
        for target, line in _imports(name, MODULES[name], type_checking=False)
        if target.split(".")[0] in FORBIDDEN_IN_CORE
    ]
    assert not bad, f"{name} imports {bad}: that belongs in the package that owns it"


# The run config's defaults name the embedded default stack (torch, fsdp, grpo, ...); that is
# the one place in the core where a plugin's component is named. The manifest records the
# version of the torch *distribution* (no component); Kind.AGENT's value is the kind's name,
# which rollout function `agent` (miles-sglang) shares.
DEFAULTS_MODULE = "miles.core.config.schema"
NOT_COMPONENTS = {("miles.runtime.rundir", "torch"), ("miles.core.contracts.components", "agent")}


def test_core_never_names_a_plugins_component() -> None:
    """No string in miles-core or miles-runtime equals the name of a component another distribution registers:
    the core branches on capabilities and memory models, never on a backend's or precision's
    name."""
    from miles.core.registry.plugins import PluginManager

    manager = PluginManager().load(strict=False)
    names = {c.name for c in manager.registry.all() if c.distribution != "miles-core"}
    assert {"fsdp", "torch", "fp8", "grpo"} <= names  # the walk sees the installed plugins
    hits = []
    for module, path in MODULES.items():
        if not module.startswith(CORE_AND_RUNTIME) or module == DEFAULTS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in names
                and (module, node.value) not in NOT_COMPONENTS
            ):
                hits.append(f"{module}:{node.lineno} {node.value!r}")
    assert not hits, "the core names plugin components: " + ", ".join(hits)


def test_the_contracts_never_import_the_runtime() -> None:
    """miles-core is what a plugin depends on without Ray: none of its modules imports
    miles.runtime, not even inside a function."""
    bad = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        if name.startswith("miles.core")
        for target, line in _imports(name, path)
        if target == "miles.runtime" or target.startswith("miles.runtime.")
    ]
    assert not bad, "\n".join(bad)


def _moved_paths() -> set[str]:
    """The old module paths miles-core keeps working with a DeprecationWarning (`_moved.py`),
    read from its source."""
    tree = ast.parse((ROOT / "packages/miles-core/src/miles/core/_moved.py").read_text())
    old: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
            old |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return old


def test_no_source_imports_a_deprecated_path() -> None:
    """The deprecated paths are for plugins written before the move; Miles' own code (src and
    tests) uses the new ones."""
    moved = _moved_paths()
    assert "miles.core.types" in moved and "miles.core.runtime.controller" in moved
    files = [*MODULES.items()]
    files += [(p.stem, p) for p in ROOT.glob("packages/*/tests/**/*.py")]
    files += [(p.stem, p) for p in ROOT.glob("tests/*.py")] + [("conftest", ROOT / "conftest.py")]
    bad = [
        f"{path.relative_to(ROOT)}:{line} {target}"
        for name, path in files
        for target, line in _imports(name, path)
        if target in moved
    ]
    assert not bad, "imports of deprecated paths:\n" + "\n".join(bad)
