"""Finding, vetting and loading plugins from the ``miles`` entry-point group.

Loading isolates each distribution: one that fails to import or to register is recorded as
``broken`` with its error and skipped, and the rest still load. A distribution whose declared
miles-core range (its ``Requires-Dist: miles-core ...``) excludes the running core is
``incompatible`` and is not imported at all.

Environment:
    MILES_LOAD_PLUGINS=a,b     load only these distributions (empty: none); miles-core always loads
    MILES_DISABLE_PLUGINS=a,b  never load these distributions
"""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pluggy
import structlog
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from miles.core.contracts import hookspecs
from miles.core.contracts.components import (
    Component,
    ComponentConflictError,
    ComponentNotFoundError,
    ComponentSpec,
    Kind,
    Registry,
)

log = structlog.get_logger(__name__)

ENTRY_POINT_GROUP = "miles"
CORE_DISTRIBUTION = "miles-core"
Status = Literal["ok", "broken", "disabled", "incompatible"]


@dataclass
class PluginRecord:
    """What `miles plugins list` shows for one distribution."""

    name: str
    version: str
    status: Status = "ok"
    error: str | None = None
    core_range: str | None = None
    entry_points: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "core_range": self.core_range,
            "entry_points": self.entry_points,
            "hooks": self.hooks,
            "components": self.components,
        }


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {canonicalize_name(n.strip()) for n in raw.split(",") if n.strip()}


def _core_range(dist: md.Distribution) -> str | None:
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) == CORE_DISTRIBUTION and not req.marker:
            return str(req.specifier) or None
    return None


def _short_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class PluginManager:
    """The loaded plugins, their records, and the registry of their components."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.registry = Registry()
        self.conflicts: list[str] = []
        self.core_version = Version(md.version(CORE_DISTRIBUTION))

    # ── loading ──────────────────────────────────────────────────────────────────────────────────

    def load(self, *, strict: bool = True) -> PluginManager:
        """Discovers and loads every distribution in the entry-point group.

        With ``strict``, a component name registered twice raises; otherwise it is kept in
        ``conflicts`` for display.
        """
        by_dist: dict[str, list[md.EntryPoint]] = defaultdict(list)
        dists: dict[str, md.Distribution] = {}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            name = canonicalize_name(dist.metadata["Name"]) if dist else f"(unknown):{ep.value}"
            by_dist[name].append(ep)
            if dist is not None:
                dists[name] = dist
        # The core first, then alphabetical: conflict messages and listings are deterministic.
        for name in sorted(by_dist, key=lambda n: (n != CORE_DISTRIBUTION, n)):
            self._load_distribution(name, dists.get(name), by_dist[name])
        if strict and self.conflicts:
            raise ComponentConflictError("; ".join(self.conflicts))
        return self

    def _load_distribution(
        self, name: str, dist: md.Distribution | None, eps: list[md.EntryPoint]
    ) -> None:
        record = PluginRecord(
            name=name,
            version=dist.version if dist else "?",
            core_range=_core_range(dist) if dist else None,
            entry_points=sorted(f"{ep.name} = {ep.value}" for ep in eps),
        )
        self.records[name] = record
        if name != CORE_DISTRIBUTION:
            allow, deny = _env_names("MILES_LOAD_PLUGINS"), _env_names("MILES_DISABLE_PLUGINS")
            if (allow is not None and name not in allow) or (deny is not None and name in deny):
                record.status = "disabled"
                return
        core_range = record.core_range
        if core_range and not SpecifierSet(core_range).contains(
            self.core_version, prereleases=True
        ):
            record.status = "incompatible"
            record.error = (
                f"requires miles-core{record.core_range}, "
                f"but miles-core {self.core_version} is installed"
            )
            return

        registered: list[tuple[str, object]] = []
        specs: list[ComponentSpec] = []
        try:
            for ep in eps:
                module = ep.load()
                plugin_name = f"{name}:{ep.name}"
                self.pm.register(module, name=plugin_name)
                registered.append((plugin_name, module))
                self.pm.check_pending()  # unknown miles_* hooks fail here, naming this plugin
                specs.extend(self._collect_specs(module))
        except Exception as exc:  # isolation: anything a plugin raises is recorded, not propagated
            for plugin_name, _ in registered:
                self.pm.unregister(name=plugin_name)
            record.status, record.error = "broken", _short_error(exc)
            log.warning("plugin failed to load", plugin=name, error=record.error)
            return

        record.hooks = sorted(
            {impl.function.__name__ for _, m in registered for impl in self._impls_of(m)}
        )
        components: dict[str, list[str]] = defaultdict(list)
        for spec in specs:
            component = Component(spec=spec, distribution=name, version=record.version)
            try:
                self.registry.add(component)
            except ComponentConflictError as exc:
                self.conflicts.append(str(exc))
                continue
            components[str(spec.kind)].append(spec.name)
        record.components = {k: sorted(v) for k, v in sorted(components.items())}

    def _impls_of(self, module: object) -> list[pluggy.HookImpl]:
        callers = self.pm.get_hookcallers(module) or []
        return [
            impl for caller in callers for impl in caller.get_hookimpls() if impl.plugin is module
        ]

    def _collect_specs(self, module: object) -> list[ComponentSpec]:
        specs: list[ComponentSpec] = []
        for impl in self._impls_of(module):
            hook_name = impl.function.__name__
            kind = hookspecs.REGISTRATION_HOOKS.get(hook_name)
            if kind is None:
                continue
            returned = cast("Iterable[object] | None", impl.function())
            for spec in returned or []:
                if not isinstance(spec, ComponentSpec):
                    raise TypeError(
                        f"{hook_name} returned {type(spec).__name__}, not ComponentSpec"
                    )
                if spec.kind != kind:
                    raise TypeError(f"{hook_name} returned a {spec.kind!r} spec ({spec.name!r})")
                specs.append(spec)
        return specs

    # ── using ────────────────────────────────────────────────────────────────────────────────────

    def get(self, kind: Kind | str, name: str) -> Component:
        """The component of this kind and name, or one a pick-one hook resolves (import paths)."""
        kind = Kind(kind)
        try:
            return self.registry.get(kind, name)
        except ComponentNotFoundError:
            spec = self.pm.hook.miles_resolve_component(kind=kind, name=name)
            if spec is None:
                raise
            return Component(spec=spec, distribution="(import path)", version="")

    def call_lifecycle(self, hook_name: str, **kwargs: Any) -> None:
        """Calls a lifecycle hook on every plugin; one that raises is logged and the rest still run."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception as exc:
                log.error(
                    "lifecycle hook failed",
                    hook=hook_name,
                    plugin=impl.plugin_name,
                    error=_short_error(exc),
                )

    def require_no_conflicts(self) -> None:
        """Raises ComponentConflictError when two distributions registered one name."""
        if self.conflicts:
            raise ComponentConflictError("; ".join(self.conflicts))

    def has_impls(self, hook_name: str) -> bool:
        """Whether any plugin implements this hook (so callers can skip costly arguments)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use: the one way library code reaches
    the plugins. A name registered twice is kept in `conflicts` (shown by `miles plugins list`);
    commands that use components call `require_no_conflicts()` first."""
    global _manager
    if _manager is None:
        _manager = PluginManager().load(strict=False)
    return _manager
