"""Docs that run: every command and example in README.md and docs/*.md runs as written here.

Each fenced block tagged ``bash``, ``sh``, ``python`` or ``yaml`` is run, file by file, top to
bottom, in one temporary directory per file (with ``.venv`` linked in, so ``.venv/bin/miles``
works as in the repo root, and ``.venv/bin`` first on PATH, so plain ``miles`` does too):

* ``bash``/``sh``: the block is one ``bash -eo pipefail`` script; every command must exit 0. A
  ``cd`` carries over to the file's next blocks, as in a terminal.
* ``python``: the block runs in a fresh interpreter of the venv. Top-level ``await`` is allowed, as
  in ``python -m asyncio`` or a notebook. When the current directory has a ``src/`` folder (a
  package the page has you scaffold), it is on ``PYTHONPATH``, standing in for ``pip install -e .``.
* ``yaml``: a run config, or part of one: it is checked as ``miles run`` checks a config (keys,
  values, component names and their options), without ``model.path`` and ``data.path``. Top-level
  keys that repeat start another config (a list of alternatives).

Blocks tagged otherwise (``text``, ``toml``, none) are output, layouts or files, and not run.

A block that cannot run in the CPU suite is marked by an HTML comment on the line just before its
fence (blank lines between are allowed):

    <!-- docs-test: template reason="..." -->     a sketch with names you fill in. Python templates
                                                  must still compile.
    <!-- docs-test: skip reason="..." -->         needs a GPU, the hub, a package index, or changes
                                                  the machine (installs, uploads); the reason says.
    <!-- docs-test: covered-by="tests/x.py::test_y" -->   a long run (``miles run``) that that test
                                                  runs; the test must exist.

A ``miles run`` without ``--help``, ``pip install``, ``twine``, ``git`` and the set-up scripts are
refused unmarked, so a slow or machine-changing command never runs here by accident. The same
convention is described for doc writers in docs/contributing.md ("Docs that run").
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import read_jsonl, run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = VENV_BIN / "python" if (VENV_BIN / "python").exists() else Path(sys.executable)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = {"bash", "sh", "python", "yaml"}
KINDS = ("template", "skip", "covered-by")
BLOCK_TIMEOUT_S = 120

_FENCE = re.compile(r"^(\s*)(`{3,})([\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?P<rest>.*?)\s*-->\s*$")
_ATTR = re.compile(r'(?:(?P<key>[\w-]+)=)?"(?P<value>[^"]*)"')
# Commands that are slow or change the machine: each needs a marker.
_REFUSED = re.compile(
    r"(^|[\s;&|(/])(miles run\b(?!.*--help)|pip install\b|twine\b|git\b|ray start\b|"
    r"tools/(setup|test)\.sh\b|python -m venv\b)"
)


@dataclass
class Marker:
    kind: str
    reason: str = ""
    line: int = 0


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: Marker | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    stray_markers: list[Marker] = field(default_factory=list)


def read_page(path: Path) -> Page:
    page = Page(path)
    lines = path.read_text().splitlines()
    pending: Marker | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MARKER.match(line)
        if m:
            if pending is not None:
                page.stray_markers.append(pending)
            rest = m.group("rest")
            attrs = {
                a.group("key") or m.group("kind"): a.group("value") for a in _ATTR.finditer(rest)
            }
            reason = attrs.get("reason") or attrs.get(m.group("kind"), "")
            pending = Marker(m.group("kind"), reason, i + 1)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, ticks, lang = fence.groups()
            j = i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                j += 1
            body = [x[len(indent) :] if x.startswith(indent) else x for x in lines[i + 1 : j]]
            block = Block(path, i + 1, lang.lower(), "\n".join(body) + "\n", pending)
            if block.lang in RUN_LANGS:
                page.blocks.append(block)
            elif pending is not None:
                page.stray_markers.append(pending)
            pending = None
            i = j + 1
            continue
        if line.strip() and pending is not None:
            page.stray_markers.append(pending)
            pending = None
        i += 1
    if pending is not None:
        page.stray_markers.append(pending)
    return page


PAGES = [read_page(p) for p in DOCS]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ── the convention itself ────────────────────────────────────────────────────────────────────────


def test_markers_are_well_formed() -> None:
    problems = []
    for page in PAGES:
        for m in page.stray_markers:
            problems.append(f"{_id(page.path)}:{m.line}: marker not followed by a runnable block")
        for b in page.blocks:
            m = b.marker
            if m is None:
                continue
            if m.kind not in KINDS:
                problems.append(f"{b.where}: unknown marker {m.kind!r} (one of {KINDS})")
            elif not m.reason:
                problems.append(f"{b.where}: a {m.kind} marker needs its reason or test")
            elif m.kind == "covered-by":
                file, _, test = m.reason.partition("::")
                source = ROOT / file
                if not source.is_file() or not re.search(
                    rf"^(async )?def {re.escape(test.split('[')[0])}\(", source.read_text(), re.M
                ):
                    problems.append(f"{b.where}: covered-by names no test: {m.reason}")
    assert not problems, "\n".join(problems)


def test_every_page_has_been_read() -> None:
    counts = {"run": 0, "marked": 0}
    for page in PAGES:
        for b in page.blocks:
            counts["marked" if b.marker else "run"] += 1
    # Printed with -s: how many blocks run here, how many are marked.
    print(f"docs blocks: {counts['run']} run, {counts['marked']} marked")
    assert counts["run"] > 30 and len(PAGES) > 10


# ── running the pages ────────────────────────────────────────────────────────────────────────────


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_", "PYTEST"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env.pop("PYTHONPATH", None)
    if (cwd / "src").is_dir():
        env["PYTHONPATH"] = str(cwd / "src")
    env["CI"] = "1"
    return env


_PY_RUNNER = """
import ast, asyncio, inspect, sys
source = open(sys.argv[1]).read()
code = compile(source, sys.argv[2], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__"})
if inspect.iscoroutine(result):
    asyncio.run(result)
"""


def _run_bash(block: Block, cwd: Path, tmp: Path) -> tuple[str | None, Path]:
    refused = [
        line for line in block.text.splitlines() if _REFUSED.search(line.split(" #")[0].strip())
    ]
    if refused:
        return (
            f"{block.where}: needs a marker (slow, or changes the machine): {refused[0].strip()}",
            cwd,
        )
    where = tmp / "cwd.txt"
    script = f"set -eo pipefail\n{block.text}\npwd > {shlex.quote(str(where))}\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return f"{block.where}: exit {proc.returncode}\n{_tail(proc)}", cwd
    return None, Path(where.read_text().strip())


def _run_python(block: Block, cwd: Path, tmp: Path) -> str | None:
    source = tmp / f"block_{block.line}.py"
    source.write_text(block.text)
    if block.marker is not None:  # a template: it must still be Python
        try:
            compile(block.text, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            return f"{block.where}: template is not valid Python: {exc}"
        return None
    runner = tmp / "run_block.py"
    runner.write_text(_PY_RUNNER)
    proc = subprocess.run(
        [str(PYTHON), str(runner), str(source), block.where],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return f"{block.where}: exit {proc.returncode}\n{_tail(proc)}"
    return None


def _tail(proc: subprocess.CompletedProcess[str]) -> str:
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return "\n".join("    " + line for line in out[-15:])


def yaml_configs(text: str) -> list[dict[str, Any]]:
    """The configs of a yaml block: a top-level key seen again starts the next one."""
    chunks: list[list[str]] = [[]]
    seen: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_][\w-]*):", line)
        if m and m.group(1) in seen:
            chunks.append([])
            seen = set()
        if m:
            seen.add(m.group(1))
        chunks[-1].append(line)
    configs = []
    for chunk in chunks:
        data = yaml.safe_load("\n".join(chunk))
        if data is not None:
            configs.append(data)
    return configs


def config_problems(data: Any) -> list[str]:
    """What `miles run` would say about this config (or section), paths to local files aside."""
    from miles.core.config import ConfigError, RunConfig
    from miles.core.registry.validation import check_config

    if not isinstance(data, dict):
        return [f"not a mapping of config sections: {data!r}"]
    top = {f.metadata.get("key", f.name) for f in dataclasses.fields(RunConfig)}
    unknown = [k for k in data if k not in top]
    if unknown:
        return [f"{k}: not a config section" for k in unknown]
    try:
        check_config(data, made_later=("model.path", "data.path"))
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize("page", PAGES, ids=[_id(p.path) for p in PAGES])
def test_page_runs_as_written(page: Page, tmp_path: Path) -> None:
    if not page.blocks:  # a page of prose and output only: listed, so a new page is never missed
        pytest.skip("no runnable blocks")
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(VENV_BIN.parent)
    failures: list[str] = []
    for block in page.blocks:
        if block.lang == "python":
            problem = _run_python(block, cwd, tmp_path)
        elif block.marker is not None:
            continue
        elif block.lang == "yaml":
            problems = [p for c in yaml_configs(block.text) for p in config_problems(c)]
            problem = f"{block.where}: " + "; ".join(problems) if problems else None
        else:
            problem, cwd = _run_bash(block, cwd, tmp_path)
        if problem:
            failures.append(problem)
    assert not failures, "\n\n".join(failures)


# ── what the pages claim, checked here ──────────────────────────────────────────────────────────


def _config_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of the run config, as config.md's table names it (``a.b``)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if f.name == getattr(cls, "__options__", None):
            continue
        key = prefix + f.metadata.get("key", f.name)
        tp = hints[f.name]
        nested = [t for t in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(t)]
        component = nested and hasattr(nested[0], "__shorthand__")
        if nested and not component and tp is not type(None):
            keys += _config_keys(typing.cast(type, nested[0]), key + ".")
        else:
            keys.append(key)
    return keys


def test_config_md_covers_every_key() -> None:
    """Every key of the run config has a row in docs/config.md (a row may list several keys of one
    section: ``a.b``, ``c``, ``d``)."""
    from miles.core.config import RewardSection, RunConfig

    text = (ROOT / "docs" / "config.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    named: set[str] = set()
    for row in rows:
        first = row.split("|")[1]
        names = re.findall(r"`([^`]+)`", first)
        if not names:
            continue
        section = names[0].rpartition(".")[0]
        named.add(names[0])
        named.update(f"{section}.{n}" if section and "." not in n else n for n in names[1:])
    # A section documented as a whole (`lora`, `train.parallel`) covers its keys; the run's own
    # keys of the reward section need rows of their own (the reward's options are its docs').
    own = [f"reward.{k}" for k in _config_keys(RewardSection) if k not in ("name", "options")]
    keys = _config_keys(RunConfig) + own

    def covered(key: str) -> bool:
        parts = key.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts))}
        return key in named or (key not in own and bool(prefixes & named))

    missing = [k for k in keys if not covered(k)]
    assert not missing, f"docs/config.md has no row for: {', '.join(missing)}"


def _block_after(path: Path, anchor: str) -> Block:
    page = next(p for p in PAGES if p.path == path)
    text = path.read_text().splitlines()
    line = next(i for i, x in enumerate(text, 1) if anchor in x)
    return next(b for b in page.blocks if b.line > line)


def test_config_md_error_example(tmp_path: Path) -> None:
    """docs/config.md's bad command prints every error it shows, at once, and nothing is built
    or written: no run directory, no assets (the quickstart's model is not made)."""
    command = _block_after(ROOT / "docs" / "config.md", "Errors name the key path")
    lines = [x for x in command.text.splitlines() if x.strip() and not x.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("miles run quickstart"), lines
    text = (ROOT / "docs" / "config.md").read_text().splitlines()
    start = next(i for i, x in enumerate(text) if x.startswith("error: invalid config:"))
    end = next(i for i, x in enumerate(text[start:]) if x.startswith("```"))
    shown = [x.strip() for x in text[start + 1 : start + end] if x.strip()]
    assert len(shown) >= 2
    proc = run_miles(*shlex.split(lines[0], comments=True)[1:], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    printed = [x.strip() for x in proc.stderr.splitlines()]
    for want in shown:
        head = want.split(" (accepted")[0]
        assert any(p.startswith(head) for p in printed), (want, proc.stderr)
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))


def test_benchmarks_step_breakdown_counts_every_stage(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """tools/bench/step_breakdown.py, as docs/benchmarks.md runs it on an existing run, finds the
    rollout and reward spans of each step wherever the tracing puts them."""
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, steps=3)
    run_dir = tmp_path / "run"
    proc = run_miles("run", str(cfg), "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_jsonl(run_dir / "traces.jsonl")
    bench = subprocess.run(
        [str(PYTHON), "tools/bench/step_breakdown.py", "--run-dir", str(run_dir), "--skip", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bench.returncode == 0, bench.stderr
    row = bench.stdout.strip().splitlines()[-1]
    total, rollout, reward, train, sync, overhead, pct = (
        float(x) for x in row.strip("| ").split(" | ")
    )
    # The table prints seconds to 3 decimals: the tiny run's reward (microseconds a call) and a
    # rollout that ran in the previous step's tail can print as 0.000, so their presence is
    # checked on the unrounded rows below; training and sync take milliseconds every step.
    assert train > 0 and sync > 0 and rollout >= 0 and reward >= 0, bench.stdout
    assert 0 <= overhead < total and 0 <= pct < 100, bench.stdout
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    try:
        import step_breakdown
    finally:
        sys.path.pop(0)
    rows = step_breakdown.breakdown(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # A step's rollout may run entirely in the previous step's tail (the next batch starts as
    # soon as the weights are out), and only its part inside the step counts: so rollout and
    # reward are required over the run, training in every step.
    assert all(sum(r[k] for r in rows) > 0 for k in ("rollout", "reward")), rows
    for r in rows:
        assert r["train"] > 0, r
        assert r["rollout"] + r["train"] <= r["total"] + 1e-9, r
    assert json.dumps(rows)
