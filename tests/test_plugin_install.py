"""Installing distributions for real: wheels into throwaway virtual environments.

Each venv gets only the wheels under test (installed by pip, so entry points and console scripts
are real). Third-party dependencies (pluggy, click, ...) are linked in from this environment, so the
test needs no network; every miles-* distribution is left out of that link-in (the helpers are in
conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import ROOT, build_wheel, make_venv, sh, venv_env

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory, core_wheel: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return {
        "miles-core": core_wheel,
        "miles-rewards": build_wheel(ROOT / "packages/miles-rewards", out),
        "miles-reward-example": build_wheel(ROOT / "examples/miles-reward-example", out),
    }


def plugins_json(env_dir: Path) -> dict[str, dict[str, object]]:
    out = sh(env_dir / "bin/miles", "plugins", "list", "--json", env=venv_env())
    return {p["name"]: p for p in json.loads(out)}


def test_core_alone_lists_only_the_core(tmp_path: Path, wheels: dict[str, Path]) -> None:
    env_dir = make_venv(tmp_path / "venv", wheels["miles-core"])
    plugins = plugins_json(env_dir)
    assert list(plugins) == ["miles-core"]
    assert plugins["miles-core"]["status"] == "ok"


def test_the_venv_sees_no_workspace_source(tmp_path: Path, wheels: dict[str, Path]) -> None:
    """Nothing of this checkout is on a throwaway venv's path (e.g. an editable install's
    `_editable_impl_miles_*.pth` linked in): the core comes from its wheel, the other packages
    are not there at all, so a module missing from a wheel cannot be found in the source tree."""
    env_dir = make_venv(tmp_path / "venv", wheels["miles-core"])
    probe = (
        "import importlib.util as u, json, sys, miles.core\n"
        "names = ['miles.losses', 'miles.torch', 'miles.rewards', 'miles.recipes']\n"
        "print(json.dumps({'path': sys.path, 'core': miles.core.__file__,\n"
        "    'found': [n for n in names if u.find_spec(n) is not None]}))"
    )
    seen = json.loads(sh(env_dir / "bin/python", "-c", probe, env=venv_env()))
    assert [p for p in seen["path"] if p.startswith(str(ROOT))] == []
    assert seen["core"].startswith(str(env_dir)), seen["core"]
    assert seen["found"] == []


def test_adding_rewards_adds_its_components(tmp_path: Path, wheels: dict[str, Path]) -> None:
    env_dir = make_venv(tmp_path / "venv", wheels["miles-core"], wheels["miles-rewards"])
    plugins = plugins_json(env_dir)
    assert set(plugins) == {"miles-core", "miles-rewards"}
    assert "exact_match" in plugins["miles-rewards"]["components"]["reward"]  # type: ignore[index]


def test_third_party_example_plugin_is_usable_by_name(
    tmp_path: Path, wheels: dict[str, Path]
) -> None:
    env_dir = make_venv(tmp_path / "venv", wheels["miles-core"], wheels["miles-reward-example"])
    example = plugins_json(env_dir)["miles-reward-example"]
    assert example["status"] == "ok" and example["error"] is None
    assert example["components"] == {"reward": ["keyword"]}
    use = (
        "import asyncio\n"
        "from miles.core.registry.plugins import get_plugin_manager\n"
        "from miles.core.contracts.types import Sample\n"
        "spec = get_plugin_manager().get('reward', 'keyword').spec\n"
        "reward = spec.factory(spec.config(keywords=['because']))\n"
        "print(asyncio.run(reward('yes, because', Sample(prompt_ids=[1]))))\n"
    )
    assert sh(env_dir / "bin/python", "-c", use).strip() == "1.0"
