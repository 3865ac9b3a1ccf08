"""docs/architecture.md is drawn from the code: every path and module it names exists, and every
distribution under packages/ has its row in the package table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs/architecture.md").read_text()
PREFIX = {
    "core/": ROOT / "packages/miles-core/src/miles/core",
    "runtime/": ROOT / "packages/miles-runtime/src/miles/runtime",
}
# `core/x.py`, `runtime/loop/`, also bare in the diagram; a path names a file or a folder.
LAYER_PATH = re.compile(r"(?<![\w/.-])((?:core|runtime)/[\w/]*\w(?:\.py)?/?)")


def _package_rows() -> dict[str, str]:
    table = DOC[DOC.index("## Packages") : DOC.index("## Where does X live")]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("miles-"):
            rows[cells[0]] = cells[1]
    return rows


def test_every_core_and_runtime_path_exists() -> None:
    named = set(LAYER_PATH.findall(DOC))
    assert len(named) > 30  # the walk sees the doc's paths
    missing = []
    for path in sorted(named):
        prefix = path.split("/", 1)[0] + "/"
        target = PREFIX[prefix] / path[len(prefix) :]
        if not target.exists():
            missing.append(path)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_it_names_imports() -> None:
    dotted = set(re.findall(r"`(miles\.[\w.]+)`", DOC))
    assert dotted
    missing = [name for name in sorted(dotted) if importlib.util.find_spec(name) is None]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_file_in_the_package_table_exists_in_its_package() -> None:
    rows = _package_rows()
    missing = []
    for dist, holds in rows.items():
        src = ROOT / "packages" / dist / "src"
        for name in re.findall(r"`([\w*]+(?:\.py|/))`", holds):
            if name.endswith("/"):
                found = any(p.is_dir() for p in src.rglob(name.rstrip("/")))
            else:
                found = any(src.rglob(name.replace("*", "*")))
            if not found:
                missing.append(f"{dist}: {name}")
    assert not missing, f"the package table names files that do not exist: {missing}"


def test_every_distribution_has_a_row() -> None:
    dists = {p.parent.name for p in ROOT.glob("packages/*/pyproject.toml")}
    assert dists == set(_package_rows())
