"""The publish-a-reward kit end to end: scaffold, build, install, check; and check catching bugs.

Both packages are real wheels installed into throwaway virtual environments next to the wheels of
miles-core and miles-plugin-kit (which brings `miles plugins new` and `check`; see conftest.py), so
entry points, package data and the `miles` script are the real ones.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from miles.plugin_kit.scaffold import RewardNames, scaffold_reward

from .conftest import ROOT, build_wheel, make_venv, sh, venv_env

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


# Four rewards, each breaking one rule that `miles plugins check` enforces.
BAD_PLUGIN = """
import random
import threading
from dataclasses import dataclass

from miles.core import ComponentSpec, Kind, hookimpl


@dataclass
class NoOptions:
    pass


class NanOnEmpty:
    reward_range = (0.0, 1.0)

    def __init__(self, config):
        pass

    async def __call__(self, response, sample):
        return float("nan") if not response else 1.0


class RaisesOnEmpty(NanOnEmpty):
    async def __call__(self, response, sample):
        return 1.0 / len(response)


class HoldsLock(NanOnEmpty):
    def __init__(self, config):
        self.lock = threading.Lock()

    async def __call__(self, response, sample):
        with self.lock:
            return 0.5


class Flaky(NanOnEmpty):
    deterministic = True

    async def __call__(self, response, sample):
        return random.random()


@hookimpl
def miles_register_rewards():
    rewards = {"nan_empty": NanOnEmpty, "raise_empty": RaisesOnEmpty, "locked": HoldsLock,
               "flaky": Flaky}
    return [ComponentSpec(Kind.REWARD, n, f, "bad on purpose", NoOptions) for n, f in rewards.items()]
"""


@pytest.fixture(scope="module")
def kit_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """miles-plugin-kit, built once for these tests."""
    return build_wheel(ROOT / "packages/miles-plugin-kit", tmp_path_factory.mktemp("kit-wheel"))


def test_scaffolded_reward_builds_installs_and_passes(
    tmp_path: Path, core_wheel: Path, kit_wheel: Path
) -> None:
    # The installed kit's `miles plugins new`: its templates ship in the wheel.
    kit_env = make_venv(tmp_path / "kit-venv", core_wheel, kit_wheel)
    help_text = sh(kit_env / "bin/miles", "plugins", "--help", env=venv_env())
    assert {"list", "show", "new", "check"} <= set(help_text.partition("Commands:")[2].split())
    new = ("plugins", "new", "reward", "acme-contains")
    out = sh(kit_env / "bin/miles", *new, cwd=tmp_path, env=venv_env())
    assert "created miles-reward-acme-contains" in out
    project = tmp_path / "miles-reward-acme-contains"
    names = RewardNames.parse("acme-contains")
    plugin_wheel = build_wheel(project, tmp_path / "dist")
    env = make_venv(tmp_path / "venv", core_wheel, kit_wheel, plugin_wheel)

    listed = sh(env / "bin/miles", "plugins", "list", env=venv_env())
    assert "miles-reward-acme-contains" in listed and "acme_contains" in listed
    out = sh(env / "bin/miles", "plugins", "check", names.dist, env=venv_env())
    assert "miles-reward-acme-contains 0.1.0: all checks passed" in out
    for check in ("builds", "sample inputs", "empty response", "picklable", "deterministic"):
        row = next(line for line in out.splitlines() if f" {check} " in line)
        assert row.split()[0] == "reward/acme_contains" and " PASS " in row, row
    # The package's own tests pass against the installed plugin, conformance test included.
    tests = sh(env / "bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=project)
    assert "2 passed" in tests

    # A reward plugin needs no Ray: in a venv of only what the three wheels declare (no runtime,
    # no Ray, no torch), it lists and passes its checks.
    bare = make_venv(tmp_path / "bare", core_wheel, kit_wheel, plugin_wheel, only_declared=True)
    probe = "import importlib.util as u; print([n for n in ('ray', 'torch', 'miles.runtime') if u.find_spec(n)])"
    assert sh(bare / "bin/python", "-c", probe).strip() == "[]"
    assert "acme_contains" in sh(bare / "bin/miles", "plugins", "list", env=venv_env())
    out = sh(bare / "bin/miles", "plugins", "check", names.dist, env=venv_env())
    assert "miles-reward-acme-contains 0.1.0: all checks passed" in out


def test_check_fails_bad_rewards_saying_what_is_wrong(
    tmp_path: Path, core_wheel: Path, kit_wheel: Path
) -> None:
    names, project = scaffold_reward("bad", tmp_path / "project")
    (project / "src" / names.module / "plugin.py").write_text(BAD_PLUGIN)
    plugin_wheel = build_wheel(project, tmp_path / "dist")
    env = make_venv(tmp_path / "venv", core_wheel, kit_wheel, plugin_wheel)

    proc = subprocess.run(
        [env / "bin/miles", "plugins", "check", names.dist],
        capture_output=True,
        text=True,
        env=venv_env(),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
    expected = [
        "FAIL reward 'flaky': declares deterministic but scored a correct answer '42' differently",
        "FAIL reward 'locked': cloudpickle cannot pickle it: TypeError: cannot pickle "
        "'_thread.lock' object",
        "FAIL reward 'nan_empty': returned nan for an empty response",
        "FAIL reward 'raise_empty': raised ZeroDivisionError: float division by zero for an empty response",
    ]
    assert len(failures) == len(expected), proc.stdout
    for line, start in zip(failures, expected, strict=True):
        assert line.replace("ray.cloudpickle", "cloudpickle").startswith(start), line
    assert "miles-reward-bad 0.1.0: 4 of 32 checks failed" in proc.stdout


def test_every_builtin_reward_passes_its_own_conformance_check() -> None:
    from .conftest import run_miles

    proc = run_miles("plugins", "check", "miles-rewards", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "all checks passed" in proc.stdout + proc.stderr
