"""Import paths of modules that moved, kept working for one release with a DeprecationWarning.

miles-core's modules were grouped by layer (contracts, config, registry, observability) and the
runtime moved to its own distribution (miles-runtime, `miles.runtime`). A plugin written against
the old paths (`from miles.core.types import Sample`) still imports: a finder on `sys.meta_path`
answers each old name with the module at its new one (the same module object, so classes and
module state are shared), and warns once per name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# Old module -> new module. Remove in miles-core 0.2.
MOVED: dict[str, str] = {
    "miles.core.hookspecs": "miles.core.contracts.hookspecs",
    "miles.core.components": "miles.core.contracts.components",
    "miles.core.backends": "miles.core.contracts.backends",
    "miles.core.protocols": "miles.core.contracts.protocols",
    "miles.core.types": "miles.core.contracts.types",
    "miles.core.family": "miles.core.contracts.family",
    "miles.core.weight_sync": "miles.core.contracts.weight_sync",
    "miles.core.memory": "miles.core.contracts.memory",
    "miles.core.algorithm": "miles.core.contracts.algorithm",
    "miles.core.recipe": "miles.core.contracts.recipe",
    "miles.core.configtools": "miles.core.config.tools",
    "miles.core.plugins": "miles.core.registry.plugins",
    "miles.core.builtin": "miles.core.registry.builtin",
    "miles.core.families": "miles.core.registry.families",
    "miles.core.factory": "miles.core.registry.factory",
    "miles.core.sinks": "miles.core.registry.jsonl_sink",
    "miles.core.validation": "miles.core.registry.validation",
    "miles.core.telemetry": "miles.core.observability.telemetry",
    "miles.core.logsetup": "miles.core.observability.logsetup",
}

# Moved out of miles-core into miles-runtime (needs `pip install miles-runtime`). The old
# `miles.core.observability` (the SDK set-up, now `miles.runtime.tracing`) has no alias: the name
# is the core's observability package now.
MOVED_TO_RUNTIME: dict[str, str] = {
    "miles.core.runner": "miles.runtime.runner",
    "miles.core.rundir": "miles.runtime.rundir",
    "miles.core.planner": "miles.runtime.planning.planner",
    "miles.core.plan_table": "miles.runtime.planning.plan_table",
    "miles.core.gpu_memory": "miles.runtime.planning.gpu_memory",
    "miles.core.generic_shape": "miles.runtime.planning.generic_shape",
    "miles.core.data": "miles.runtime.data.source",
    "miles.core.data_check": "miles.runtime.data.check",
    "miles.core.runtime.controller": "miles.runtime.loop.controller",
    "miles.core.runtime.warmstart": "miles.runtime.loop.warmstart",
    "miles.core.runtime.snapshots": "miles.runtime.loop.snapshots",
    "miles.core.runtime.checkpoints": "miles.runtime.loop.checkpoints",
    "miles.core.runtime.interrupts": "miles.runtime.loop.interrupts",
    "miles.core.runtime.weight_updates": "miles.runtime.loop.weight_updates",
    "miles.core.runtime.progress": "miles.runtime.loop.progress",
    "miles.core.runtime.metric_log": "miles.runtime.loop.metric_log",
    "miles.core.runtime.rollout_manager": "miles.runtime.rollout.rollout_manager",
    "miles.core.runtime.dispatch": "miles.runtime.rollout.dispatch",
    "miles.core.runtime.producer": "miles.runtime.rollout.producer",
    "miles.core.runtime.prompts": "miles.runtime.rollout.prompts",
    "miles.core.runtime.scoring": "miles.runtime.rollout.scoring",
    "miles.core.runtime.buffer": "miles.runtime.rollout.buffer",
    "miles.core.runtime.ledger": "miles.runtime.rollout.ledger",
    "miles.core.runtime.rollout_metrics": "miles.runtime.rollout.rollout_metrics",
    "miles.core.runtime.train_actor": "miles.runtime.actors.train_actor",
    "miles.core.runtime.train_group": "miles.runtime.actors.train_group",
    "miles.core.runtime.engine_actor": "miles.runtime.actors.engine_actor",
    "miles.core.runtime.engine_group": "miles.runtime.actors.engine_group",
    "miles.core.runtime.engine_pool": "miles.runtime.actors.engine_pool",
    "miles.core.runtime.placement": "miles.runtime.cluster.placement",
    "miles.core.runtime.bundles": "miles.runtime.cluster.bundles",
    "miles.core.runtime.process": "miles.runtime.cluster.process",
    "miles.core.runtime": "miles.runtime",
}


def new_name(old: str) -> str | None:
    """Where the module `old` lives now, or None if it did not move."""
    return MOVED.get(old) or MOVED_TO_RUNTIME.get(old)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        try:
            target = importlib.import_module(self.target)
        except ModuleNotFoundError as exc:
            if old in MOVED_TO_RUNTIME and exc.name and exc.name.startswith("miles.runtime"):
                raise ModuleNotFoundError(
                    f"{old} moved to {self.target}, in the miles-runtime distribution: "
                    "pip install miles-runtime",
                    name=old,
                ) from None
            raise
        warnings.warn(
            f"{old} is deprecated: import {self.target} instead (the old path goes in "
            "miles-core 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system returns what sys.modules holds after exec_module: the real module.
        sys.modules[old] = target


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=False)


def install() -> None:
    """Adds the finder once (after the standard ones: a real module always wins)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
