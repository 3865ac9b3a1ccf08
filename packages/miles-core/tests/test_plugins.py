"""Plugin loading: isolation, allow/block lists, core-range checks, conflicts, resolution."""

from __future__ import annotations

import sys

import pytest

from miles.core import ComponentSpec, Kind
from miles.core.contracts.components import ComponentConflictError, ComponentNotFoundError
from miles.core.contracts.types import Sample, split_by_token_budget
from miles.core.registry.plugins import PluginManager

from .conftest import REWARD_PLUGIN, PlantFn


def test_core_registers_itself_through_the_entry_point() -> None:
    manager = PluginManager().load()
    core = manager.records["miles-core"]
    assert core.status == "ok"
    assert "miles_register_metric_sinks" in core.hooks
    assert manager.registry.get(Kind.METRIC_SINK, "jsonl").distribution == "miles-core"


def test_broken_plugin_is_isolated(plant: PlantFn) -> None:
    plant("good-plugin", REWARD_PLUGIN.format(name="good"))
    plant("broken-plugin", "import a_module_that_does_not_exist\n")
    manager = PluginManager().load()
    broken = manager.records["broken-plugin"]
    assert broken.status == "broken"
    assert "ModuleNotFoundError" in broken.error and "a_module_that_does_not_exist" in broken.error
    assert manager.records["good-plugin"].status == "ok"
    assert manager.registry.get(Kind.REWARD, "good").distribution == "good-plugin"


def test_registration_error_marks_plugin_broken_and_unregisters_it(plant: PlantFn) -> None:
    plant(
        "raising",
        """
        from miles.core import hookimpl
        @hookimpl
        def miles_register_rewards():
            raise RuntimeError("boom in registration")
        @hookimpl
        def miles_on_run_start(run):
            pass
    """,
    )
    manager = PluginManager().load()
    assert manager.records["raising"].status == "broken"
    assert "boom in registration" in manager.records["raising"].error
    assert not manager.pm.hook.miles_on_run_start.get_hookimpls()


def test_unknown_hook_and_wrong_kind_are_broken(plant: PlantFn) -> None:
    plant(
        "typo",
        """
        from miles.core import hookimpl
        @hookimpl
        def miles_register_rewardz():
            return []
    """,
    )
    plant(
        "wrongkind",
        """
        from miles.core import ComponentSpec, Kind, hookimpl
        @hookimpl
        def miles_register_rewards():
            return [ComponentSpec(Kind.LOSS, "x", print, "a loss in the reward hook")]
    """,
    )
    manager = PluginManager().load()
    assert manager.records["typo"].status == "broken"
    assert "miles_register_rewardz" in manager.records["typo"].error
    assert manager.records["wrongkind"].status == "broken"
    assert "loss" in manager.records["wrongkind"].error


def test_incompatible_core_range_is_not_imported(plant: PlantFn) -> None:
    module = plant("too-new", REWARD_PLUGIN.format(name="new"), core_range=">=9.0")
    manager = PluginManager().load()
    record = manager.records["too-new"]
    assert record.status == "incompatible"
    assert "miles-core>=9.0" in record.error and str(manager.core_version) in record.error
    assert module not in sys.modules
    with pytest.raises(ComponentNotFoundError):
        manager.registry.get(Kind.REWARD, "new")


def test_allowlist_and_blocklist(plant: PlantFn, monkeypatch: pytest.MonkeyPatch) -> None:
    plant("alpha", REWARD_PLUGIN.format(name="a"))
    plant("beta", REWARD_PLUGIN.format(name="b"))

    monkeypatch.setenv("MILES_LOAD_PLUGINS", "")
    statuses = {n: r.status for n, r in PluginManager().load().records.items()}
    assert statuses["alpha"] == statuses["beta"] == "disabled"
    assert statuses["miles-core"] == "ok"  # the core is the framework itself

    monkeypatch.setenv("MILES_LOAD_PLUGINS", "Alpha")  # names are compared canonically
    statuses = {n: r.status for n, r in PluginManager().load().records.items()}
    assert (statuses["alpha"], statuses["beta"]) == ("ok", "disabled")

    monkeypatch.delenv("MILES_LOAD_PLUGINS")
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "beta")
    statuses = {n: r.status for n, r in PluginManager().load().records.items()}
    assert (statuses["alpha"], statuses["beta"]) == ("ok", "disabled")


def test_name_conflict_names_both_distributions(plant: PlantFn) -> None:
    plant("first-dist", REWARD_PLUGIN.format(name="same"), version="1.2.3")
    plant("second-dist", REWARD_PLUGIN.format(name="same"), version="4.5.6")
    with pytest.raises(ComponentConflictError) as err:
        PluginManager().load()
    message = str(err.value)
    assert "first-dist 1.2.3" in message and "second-dist 4.5.6" in message
    relaxed = PluginManager().load(strict=False)
    assert len(relaxed.conflicts) == 1


def test_unknown_name_suggests_close_matches() -> None:
    manager = PluginManager().load()
    with pytest.raises(ComponentNotFoundError, match=r"did you mean 'jsonl'"):
        manager.get(Kind.METRIC_SINK, "jsonlines")


def test_import_path_resolves_one_off_components() -> None:
    manager = PluginManager().load()
    component = manager.get(Kind.REWARD, "miles.core.contracts.types:Sample")
    assert component.spec.factory is Sample  # a class is its own factory
    function = manager.get(Kind.REWARD, "miles.core.contracts.types:split_by_token_budget")
    assert function.spec.factory() is split_by_token_budget  # a function is the component
    with pytest.raises(LookupError, match="cannot import"):
        manager.get(Kind.REWARD, "no_such_module:thing")


def test_lifecycle_hook_failure_does_not_stop_others(plant: PlantFn) -> None:
    seen = plant(
        "observer",
        """
        calls = []
        from miles.core import hookimpl
        @hookimpl
        def miles_after_train_step(run, step, metrics):
            calls.append(step)
    """,
    )
    plant(
        "faulty",
        """
        from miles.core import hookimpl
        @hookimpl
        def miles_after_train_step(run, step, metrics):
            raise ValueError("faulty observer")
    """,
    )
    manager = PluginManager().load()
    manager.call_lifecycle("miles_after_train_step", run=None, step=3, metrics={})
    assert sys.modules[seen].calls == [3]


def test_component_spec_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="invalid component name"):
        ComponentSpec(Kind.REWARD, "has space", print, "x")
