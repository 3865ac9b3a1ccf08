"""The `miles` CLI: version, plugins list/show, components list, start-up time."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
from click.testing import CliRunner

from miles.core import __version__
from miles.core.cli import cli

from .conftest import REWARD_PLUGIN, PlantFn


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_version() -> None:
    assert __version__ in run("--version")


def test_plugins_list_json_shape(plant: PlantFn) -> None:
    plant("json-plugin", REWARD_PLUGIN.format(name="from_json_plugin"), version="2.0.1")
    plant("bad-plugin", "raise ImportError('cannot import this')\n")
    data = {p["name"]: p for p in json.loads(run("plugins", "list", "--json"))}
    good = data["json-plugin"]
    assert {"name", "version", "status", "error", "hooks", "components"} <= good.keys()
    assert good["version"] == "2.0.1" and good["status"] == "ok" and good["error"] is None
    assert good["components"] == {"reward": ["from_json_plugin"]}
    assert good["hooks"] == ["miles_register_rewards"]
    assert data["bad-plugin"]["status"] == "broken"
    assert "cannot import this" in data["bad-plugin"]["error"]


def test_plugins_list_table_groups_by_kind(plant: PlantFn) -> None:
    plant("table-plugin", REWARD_PLUGIN.format(name="tabled"))
    out = run("plugins", "list")
    assert out.splitlines()[0].split() == ["NAME", "VERSION", "STATUS", "COMPONENTS"]
    line = next(x for x in out.splitlines() if x.startswith("table-plugin"))
    assert line.split()[1:] == ["1.0.0", "ok", "reward:", "tabled"]


def test_plugins_list_reports_conflicts_and_fails(plant: PlantFn) -> None:
    plant("one", REWARD_PLUGIN.format(name="dup"))
    plant("two", REWARD_PLUGIN.format(name="dup"))
    result = CliRunner().invoke(cli, ["plugins", "list"])
    assert result.exit_code == 1
    assert "one 1.0.0" in result.output and "two 1.0.0" in result.output


def test_plugins_show() -> None:
    out = run("plugins", "show", "miles-core")
    assert "status:" in out and "metric_sink/jsonl" in out
    result = CliRunner().invoke(cli, ["plugins", "show", "miles-cor"])
    assert result.exit_code != 0 and "Did you mean: miles-core" in result.output


def test_components_list_filters_by_kind(plant: PlantFn) -> None:
    plant("comp-plugin", REWARD_PLUGIN.format(name="listed"))
    rows = json.loads(run("components", "list", "--kind", "reward", "--json"))
    listed = next(r for r in rows if r["name"] == "listed")
    assert listed == {
        "kind": "reward",
        "name": "listed",
        "distribution": "comp-plugin",
        "version": "1.0.0",
        "summary": "always one",
        "capabilities": [],
    }

    assert all(r["kind"] == "reward" for r in rows)
    bad = CliRunner().invoke(cli, ["components", "list", "--kind", "rewards"])
    assert bad.exit_code == 2 and "unknown kind 'rewards'" in bad.output


@pytest.mark.parametrize(
    "args", [["--help"], ["plugins", "--help"], ["plugins", "list"], ["components", "list"]]
)
def test_help_is_fast_and_imports_no_heavy_modules(args: list[str]) -> None:
    # CPU time, not wall time: the suite runs tests side by side, so a busy machine would stretch
    # the wall time of a start-up that does no more work. CPU time still grows a little when the
    # other core thrashes the shared caches, so the best of two runs is what is bounded.
    code = (
        "import sys, time; t=time.process_time(); from miles.core.cli import main\n"
        f"sys.argv=['miles', *{args!r}]\n"
        "try: main()\nexcept SystemExit: pass\n"
        "heavy=[m for m in ('torch','ray','transformers','opentelemetry.sdk','httpx2') if m in sys.modules]\n"
        "print('HEAVY', heavy, time.process_time()-t)"
    )
    runs = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
        assert "HEAVY []" in out.stdout, out.stdout
    cpu = min(runs)
    assert cpu < 1.5, f"`miles {' '.join(args)}` took {cpu:.2f}s of CPU"
