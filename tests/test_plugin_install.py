"""Installing distributions for real: wheels into throwaway virtual environments.

Each venv gets only the wheels under test (installed by pip, so entry points and console scripts
are real). Third-party dependencies (pluggy, click, ...) are linked in from this environment, so the
test needs no network; every miles-* distribution is left out of that link-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sh(*args: str | Path, **kw: object) -> str:
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return str(out.stdout)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    sources = {
        "miles-core": ROOT / "packages/miles-core",
        "miles-rewards": ROOT / "packages/miles-rewards",
        "miles-reward-example": ROOT / "examples/miles-reward-example",
    }
    for src in sources.values():
        _sh(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            src,
        )
    built = {p.name.split("-")[0].replace("_", "-"): p for p in out.glob("*.whl")}
    return {name: built[name] for name in sources}


def _is_miles(entry: str) -> bool:
    lowered = entry.lower().replace("-", "_")
    return lowered.startswith(("miles", "__editable__.miles", "_miles"))


def make_venv(path: Path, *wheels_to_install: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not _is_miles(entry.name) and entry.name != "__pycache__":
            (site / entry.name).symlink_to(entry)
    _sh(
        sys.executable,
        "-m",
        "pip",
        "--python",
        path / "bin/python",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        *wheels_to_install,
    )
    return path


def plugins_json(env_dir: Path) -> dict[str, dict[str, object]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_", "PYTHON"))}
    out = _sh(env_dir / "bin/miles", "plugins", "list", "--json", env=clean)
    return {p["name"]: p for p in json.loads(out)}


def test_core_alone_lists_only_the_core(tmp_path: Path, wheels: dict[str, Path]) -> None:
    env_dir = make_venv(tmp_path / "venv", wheels["miles-core"])
    plugins = plugins_json(env_dir)
    assert list(plugins) == ["miles-core"]
    assert plugins["miles-core"]["status"] == "ok"


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
        "from miles.core.plugins import get_plugin_manager\n"
        "from miles.core.types import Sample\n"
        "spec = get_plugin_manager().get('reward', 'keyword').spec\n"
        "reward = spec.factory(spec.config(keywords=['because']))\n"
        "print(asyncio.run(reward('yes, because', Sample(prompt_ids=[1]))))\n"
    )
    assert _sh(env_dir / "bin/python", "-c", use).strip() == "1.0"
