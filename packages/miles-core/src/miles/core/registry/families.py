"""Finding a checkpoint's model family among the installed ones, and what it says about a run.

One lookup for everything: a config.json's own `model_type` first, then its text model's (a
multimodal wrapper's family, else its language model's). Torch-free: it reads config.json only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.core.config import ReplayMode
from miles.core.contracts.components import Kind
from miles.core.contracts.family import Config, ModelFamily, Notice, text_config
from miles.core.registry.plugins import get_plugin_manager


def family_named(name: str) -> ModelFamily:
    """The installed family registered as `name` (LookupError naming the installed ones)."""
    family: ModelFamily = get_plugin_manager().get(Kind.FAMILY, name).spec.factory()
    return family


def installed_families() -> list[ModelFamily]:
    return [family_named(n) for n in get_plugin_manager().registry.names(Kind.FAMILY)]


def family_of_config(config: Config) -> ModelFamily | None:
    """The family for a config.json: by its own model_type, else its text model's."""
    families = installed_families()
    for model_type in (config.get("model_type"), text_config(config).get("model_type")):
        for family in families:
            if model_type and model_type in family.model_types:
                return family
    return None


def read_config(model_path: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json; None for a hub id or a directory without one."""
    file = Path(model_path) / "config.json"
    if not model_path or not file.is_file():
        return None
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else None


def model_config(model_path: str) -> tuple[dict[str, Any], ModelFamily | None] | None:
    """(config.json, family) of a local checkpoint, or of a hub id some family knows; None if
    neither."""
    config = read_config(model_path)
    if config is not None:
        return config, family_of_config(config)
    for family in installed_families():
        if model_path in family.checkpoints and family.config_for is not None:
            known = family.config_for(model_path)
            if known is not None:
                return known, family
    return None


def notices_for(model_path: str, family_name: str | None = None) -> list[Notice]:
    """The notices of a local checkpoint's family (`family_name` overrides detection); [] for
    a hub id or a model no family covers."""
    config = read_config(model_path)
    if config is None:
        return []
    if family_name is not None:
        try:
            family: ModelFamily | None = family_named(family_name)
        except LookupError:
            return []  # validation says so
    else:
        family = family_of_config(config)
    if family is None:
        return []
    return [Notice(f"{family.name}: {n.message}", n.fatal) for n in family.notices(config)]


def record_mode(model_path: str, replay: ReplayMode) -> ReplayMode:
    """What engines record: every MoE model with a router adapter records expert ids (so the
    trainer can report `moe/routing_agreement` even with replay off); weights only when
    replayed."""
    config = read_config(model_path)
    family = family_of_config(config) if config is not None else None
    if family is None or family.router is None:
        return "off"
    return "ids+weights" if replay == "ids+weights" else "ids"


def replay_problem(model_path: str, replay: ReplayMode) -> str | None:
    """Why `replay` cannot work on this model (before launch), or None."""
    if replay == "off":
        return None
    config = read_config(model_path)
    if config is None:
        return None  # a hub id: the engines say so at load time
    family = family_of_config(config)
    model_type = text_config(config).get("model_type") or config.get("model_type")
    if family is None:
        return (
            f"moe.routing_replay: no installed model family covers model_type {model_type!r}, so "
            "nothing knows its routers; use moe.routing_replay: off, or add a family with a "
            "router adapter (see docs/moe-routing-replay.md)"
        )
    if family.router is None:
        return (
            f"moe.routing_replay: model.path is a dense {model_type!r} model (family "
            f"{family.name!r} has no MoE router); use moe.routing_replay: off"
        )
    return None
