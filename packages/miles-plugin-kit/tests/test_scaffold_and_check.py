"""`miles plugins new reward` and the reward conformance checks, in process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles.core import Capability, ComponentSpec, Kind
from miles.core.cli import cli
from miles.core.contracts.types import Sample
from miles.plugin_kit.conformance import CHECKS, Case, CheckResult, check_reward, default_sample
from miles.plugin_kit.scaffold import (
    RewardNames,
    ScaffoldError,
    core_range,
    kit_range,
    scaffold_reward,
)

from .conftest import OnlyFn, PlantFn

# ── names and the scaffolded files ───────────────────────────────────────────────────────────────


def test_names_derive_from_one_reward_name() -> None:
    names = RewardNames.parse("math-verify")
    assert names == RewardNames(
        "math_verify", "miles-reward-math-verify", "miles_reward_math_verify", "MathVerify"
    )
    assert RewardNames.parse("miles-reward-math_verify") == names  # prefix dropped, _ and - alike


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("Math", "use lowercase, e.g. 'math'"),
        ("9lives", "starting with a letter"),
        ("a--b", "joined by '-' or '_'"),
        ("has space", "invalid reward name"),
        ("", "invalid reward name"),
        ("x" * 41, "longer than 40"),
    ],
)
def test_bad_names_are_refused_with_the_rule(name: str, says: str) -> None:
    with pytest.raises(ScaffoldError) as info:
        RewardNames.parse(name)
    assert says in str(info.value)


def test_core_and_kit_ranges_are_the_running_series() -> None:
    assert core_range("0.1.0") == ">=0.1,<0.2"
    assert core_range("0.3.7.dev1") == ">=0.3,<0.4"
    assert core_range("1.4.2") == ">=1.4,<2"
    assert kit_range("0.2.1") == ">=0.2,<0.3"
    with pytest.raises(ScaffoldError, match="cannot derive a miles-plugin-kit range"):
        kit_range("not a version")


def test_scaffold_writes_a_complete_package(tmp_path: Path) -> None:
    _, root = scaffold_reward("acme", tmp_path / "pkg")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        ".gitignore",
        "README.md",
        "pyproject.toml",
        "src/miles_reward_acme/__init__.py",
        "src/miles_reward_acme/plugin.py",
        "tests/test_reward.py",
    ]
    for path in root.rglob("*"):
        if path.is_file():
            assert "{{" not in path.read_text(), path
            if path.suffix == ".py":
                compile(path.read_text(), str(path), "exec")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == "miles-reward-acme" and project["version"] == "0.1.0"
    assert project["dependencies"] == [f"miles-core{core_range()}"]
    # The package's tests import the checks, so its `test` extra brings the kit.
    assert project["optional-dependencies"]["test"] == [
        "pytest>=8",
        f"miles-plugin-kit{kit_range()}",
    ]
    assert project["entry-points"]["miles"] == {"acme": "miles_reward_acme.plugin"}
    readme = (root / "README.md").read_text()
    assert "miles plugins check miles-reward-acme" in readme and "twine upload" in readme


def test_scaffolded_reward_passes_its_own_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, root = scaffold_reward("acme-passes", tmp_path / "pkg")
    monkeypatch.syspath_prepend(str(root / "src"))
    from miles_reward_acme_passes.plugin import SPEC

    results = check_reward(SPEC)
    assert [r.check for r in results] == list(CHECKS)
    assert all(r.passed for r in results), results
    assert {r.check for r in results if r.status == "SKIP"} == {"score_group"}


def test_scaffold_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mine.txt").write_text("keep me")
    with pytest.raises(ScaffoldError, match="already exists; not overwriting"):
        scaffold_reward("acme", tmp_path / "pkg")
    assert [p.name for p in (tmp_path / "pkg").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # no staging folder left behind


def test_scaffold_refuses_an_installed_reward_name(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="'exact_match' is already installed"):
        scaffold_reward("exact-match", tmp_path / "pkg", taken=["exact_match"])


def test_cli_new_defaults_to_the_distribution_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, only: OnlyFn
) -> None:
    monkeypatch.chdir(tmp_path)
    only()  # the core and the kit: fast, and nothing taken
    result = CliRunner().invoke(cli, ["plugins", "new", "reward", "acme-cli"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "miles-reward-acme-cli" / "src/miles_reward_acme_cli/plugin.py").is_file()
    again = CliRunner().invoke(cli, ["plugins", "new", "reward", "acme-cli"])
    assert again.exit_code == 1 and "not overwriting" in again.output
    bad = CliRunner().invoke(cli, ["plugins", "new", "reward", "Acme"])
    assert bad.exit_code == 1 and "use lowercase" in bad.output


def test_the_kit_adds_new_and_check_to_miles_plugins() -> None:
    # A fresh process, as a user runs it: `plugins` is built in, its kit commands load lazily.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    miles = [sys.executable, "-m", "miles.core.cli"]
    listed = subprocess.run([*miles, "plugins", "--help"], capture_output=True, text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    commands = listed.stdout.partition("Commands:")[2].split()
    assert {"list", "show", "new", "check"} <= set(commands), listed.stdout
    one = subprocess.run(
        [*miles, "plugins", "check", "--help"], capture_output=True, text=True, env=env
    )
    assert one.returncode == 0 and "Conformance checks" in one.stdout, one.stderr


# ── conformance checks ───────────────────────────────────────────────────────────────────────────


@dataclass
class Options:
    bonus: float = 0.0


class Good:
    reward_range = (0.0, 1.0)
    deterministic = True

    def __init__(self, config: Options) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        return min(1.0, len(response) / 100 + self.config.bonus)

    async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]:
        return [await self(r, s) for r, s in zip(responses, samples, strict=True)]


def _spec(factory: object, config: type | None = Options, groups: bool = True) -> ComponentSpec:
    """A reward spec; these probe rewards have `score_group` and say so, unless not `groups`."""
    capabilities = frozenset({Capability.SCORES_GROUPS}) if groups else frozenset()
    return ComponentSpec(
        Kind.REWARD,
        "probe",
        factory,
        "test reward",
        config,
        capabilities=capabilities,  # type: ignore[arg-type]
    )


def test_score_group_and_the_declaration_must_agree() -> None:
    undeclared = _failures(check_reward(_spec(Good, groups=False)))["score_group"]
    assert "does not declare Capability.SCORES_GROUPS: runs would never call it" in undeclared

    class PerSample:
        reward_range = (0.0, 1.0)

        def __init__(self, config: Options) -> None:
            pass

        async def __call__(self, response: str, sample: Sample) -> float:
            return 0.5

    missing = _failures(check_reward(_spec(PerSample)))["score_group"]
    assert "declares scores_groups, but there is no score_group method" in missing


def _failures(results: list[CheckResult]) -> dict[str, str]:
    return {r.check: r.detail for r in results if not r.passed}


def test_a_good_reward_passes_every_check() -> None:
    results = check_reward(_spec(Good))
    assert [(r.check, r.status) for r in results] == [(c, "PASS") for c in CHECKS]
    assert "reward_range=(0.0, 1.0); deterministic" in results[1].detail


def test_out_of_range_and_non_numbers_fail() -> None:
    class OutOfRange(Good):
        async def __call__(self, response: str, sample: Sample) -> float:
            return 2.0

    class ReturnsText(Good):
        async def __call__(self, response: str, sample: Sample) -> float:
            return "1.0"  # type: ignore[return-value]

    failed = _failures(check_reward(_spec(OutOfRange)))
    assert failed["sample inputs"].startswith(
        "returned 2.0, outside its reward_range (0.0, 1.0), for a correct answer '42'"
    )
    # Good.score_group calls the same __call__, so the group scores are out of range too.
    assert failed["score_group"].startswith("score_group returned 2.0, outside its reward_range")
    failed = _failures(check_reward(_spec(ReturnsText)))
    assert failed["sample inputs"].startswith("returned str ('1.0') for a correct answer")


def test_sync_rewards_builds_and_bad_declarations_are_named() -> None:
    def sync_reward(response: str, sample: Sample) -> float:
        return 1.0

    failed = _failures(check_reward(sync_reward))
    assert "define `async def __call__`" in failed["sample inputs"]

    @dataclass
    class Required:
        url: str  # no default: `reward: {name: probe}` could not build it

    failed = _failures(check_reward(_spec(Good, Required)))
    assert failed == {"builds": failed["builds"]}
    assert "every config field needs a default" in failed["builds"]

    class BadRange(Good):
        reward_range = (1.0, 0.0)

    assert "is not a range" in _failures(check_reward(_spec(BadRange)))["declarations"]


def test_garbage_group_pickling_and_determinism_failures() -> None:
    class Fragile(Good):
        deterministic = False

        def __init__(self, config: Options) -> None:
            super().__init__(config)
            self.lock = threading.Lock()

        async def __call__(self, response: str, sample: Sample) -> float:
            if len(response) > 1_000_000:
                raise MemoryError
            return 0.0

        async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]:
            return [0.0]

    failed = _failures(check_reward(_spec(Fragile)))
    assert set(failed) == {"garbage responses", "score_group", "picklable"}
    assert failed["garbage responses"].startswith("raised MemoryError for a huge response (2 MB)")
    assert "score_group returned 1 scores for a group of 6 responses" in failed["score_group"]
    assert "cannot pickle '_thread.lock' object" in failed["picklable"]

    class Counter(Good):
        calls = 0

        async def __call__(self, response: str, sample: Sample) -> float:
            Counter.calls += 1
            return (Counter.calls % 2) / 2

    assert "differently across" in _failures(check_reward(_spec(Counter)))["deterministic"]


def test_slow_rewards_time_out_and_custom_cases_are_used() -> None:
    class Slow(Good):
        async def __call__(self, response: str, sample: Sample) -> float:
            await asyncio.sleep(0 if response else 5)
            return 0.0

    failed = _failures(check_reward(_spec(Slow), timeout=0.2))
    assert failed["empty response"] == "took longer than 0.2 s for an empty response"

    seen: list[str] = []

    class Records(Good):
        async def __call__(self, response: str, sample: Sample) -> float:
            seen.append(sample.metadata.get("question", ""))
            return 0.0

    mine = [Case("my case", "hello", Sample(prompt_ids=[1], metadata={"question": "q?"}))]
    check_reward(_spec(Records), cases=mine)
    # Empty and garbage responses answer the given row too, not the built-in one.
    assert seen and set(seen) == {"q?"} and default_sample().metadata["answer"] == "42"

    results = check_reward(_spec(Good), config=Options(bonus=-5.0))  # a config given, not defaults
    assert results[0].detail == "built with Options(bonus=-5.0)"
    assert "outside its reward_range" in _failures(results)["sample inputs"]
    with pytest.raises(ValueError, match="at least one Case"):
        check_reward(_spec(Good), cases=[])


# ── `miles plugins check` ────────────────────────────────────────────────────────────────────────

PLANTED = """
from miles.core import ComponentSpec, Kind, hookimpl

class Fine:
    reward_range = (0.0, 1.0)
    async def __call__(self, response, sample):
        return 1.0

class NanOnEmpty(Fine):
    async def __call__(self, response, sample):
        return float("nan") if not response else 1.0

@hookimpl
def miles_register_rewards():
    return [ComponentSpec(Kind.REWARD, "fine", Fine, "ok"),
            ComponentSpec(Kind.REWARD, "bad", NanOnEmpty, "nan on empty")]
"""


def test_cli_check_reports_a_table_and_fails(plant: PlantFn, only: OnlyFn) -> None:
    plant("planted-rewards", PLANTED)
    only("planted-rewards")
    result = CliRunner().invoke(cli, ["plugins", "check", "planted-rewards"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["COMPONENT", "CHECK", "RESULT", "DETAIL"]
    assert "FAIL reward 'bad': returned nan for an empty response" in lines
    assert "planted-rewards 1.0.0: 1 of 16 checks failed" in lines
    fine = [line for line in lines if line.startswith("reward/fine ")]
    assert len(fine) == len(CHECKS) and not any(" FAIL " in line for line in fine)

    one = CliRunner().invoke(cli, ["plugins", "check", "reward/fine"])
    assert one.exit_code == 0 and "reward 'fine': all checks passed" in one.output


def test_cli_check_explains_what_it_cannot_check(only: OnlyFn) -> None:
    only()
    missing = CliRunner().invoke(cli, ["plugins", "check", "miles-cor"])
    assert missing.exit_code == 1 and "Did you mean: miles-core" in missing.output
    nothing = CliRunner().invoke(cli, ["plugins", "check", "miles-core"])
    assert nothing.exit_code == 1 and "provides no reward to check" in nothing.output
    other = CliRunner().invoke(cli, ["plugins", "check", "loss/ppo"])
    assert other.exit_code == 1 and "only rewards can be checked" in other.output
