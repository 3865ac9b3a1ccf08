"""Typed config sections from plain dicts, with errors that name the key path and the fix.

A section is a dataclass. `build(cls, data, path)` checks every key and value against the field
types (nested dataclasses, Literal, Optional, list, dict, int, float, str, bool) and collects all
problems before raising, so a user sees every mistake in one go.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """One or more invalid config values; each message starts with the key path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


def closest(name: str, choices: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def build(cls: type[T], data: Any, path: str = "") -> T:
    """An instance of dataclass `cls` from `data`, or ConfigError listing every problem."""
    value, problems = build_partial(cls, data, path)
    if problems:
        raise ConfigError(problems)
    return typing.cast(T, value)


def build_partial(cls: type[T], data: Any, path: str = "") -> tuple[T | None, list[str]]:
    """`cls` from `data` with every bad value left at its default, and the problems found.

    The instance lets later checks (a component's own options) run on the rest of the config,
    so that one report can hold every mistake. It is None only where a required value is bad."""
    problems: list[str] = []
    value = _convert(cls, data, path, problems)
    return typing.cast("T | None", value), problems


def to_dict(obj: Any) -> Any:
    """A dataclass instance back to plain dicts and lists (for config.yaml)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if f.name == getattr(obj, "__options__", None):
                out.update(value)  # options are written flat, as the user wrote them
            else:
                out[f.metadata.get("key", f.name)] = value
        return out
    if isinstance(obj, list | tuple):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(typing.cast(type, tp), value, path, problems)
    if origin is typing.Literal:
        allowed = get_args(tp)
        if isinstance(value, bool):
            # YAML 1.1 reads a bare off/on (or no/yes) as a boolean: take the word back.
            words = [w for w in _BOOL_WORDS[value] if w in allowed]
            value = words[0] if words else value
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            hint = closest(str(value), [str(a) for a in allowed])
            problems.append(f"{path}: {value!r} is not one of {shown}{hint}")
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            trial: list[str] = []
            converted = _convert(option, value, path, trial)
            if not trial:
                return converted
        names = " or ".join(_type_name(o) for o in options)
        problems.append(f"{path}: expected {names}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            problems.append(f"{path}: expected a list, got {value!r}")
            return value
        (item_type, *_) = get_args(tp) or (Any,)
        return [_convert(item_type, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
            return value
        return dict(value)
    if tp is float:
        if isinstance(value, str):
            value = _yaml11_float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(f"{path}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            problems.append(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _convert_dataclass(cls: type, value: Any, path: str, problems: list[str]) -> Any:
    """Keys map to fields (``metadata["key"]`` renames one, e.g. ``async``). A class may declare
    ``__shorthand__`` (a scalar value fills that field) and ``__options__`` (a dict field that
    collects unknown keys for a component's own config to check later)."""
    shorthand, options = getattr(cls, "__shorthand__", None), getattr(cls, "__options__", None)
    if value is None:
        value = {}
    if shorthand and isinstance(value, str | int | float):
        value = {shorthand: value}
    if not isinstance(value, dict):
        problems.append(f"{path or 'config'}: expected a mapping, got {value!r}")
        return None
    fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    bad: set[str] = set()
    for key, raw in value.items():
        field = fields.get(str(key))
        if field is None or field.name == options:
            if options:
                extra[str(key)] = raw
                continue
            problems.append(
                f"{_key(path, str(key))}: unknown key{closest(str(key), fields)} "
                f"(accepted: {', '.join(fields)})"
            )
            continue
        found: list[str] = []
        converted = _convert(hints[field.name], raw, _key(path, str(key)), found)
        if found:  # reported; the field keeps its default so the rest can still be checked
            problems.extend(found)
            bad.add(str(key))
            continue
        kwargs[field.name] = converted
    if options:
        kwargs[options] = extra
    missing = [
        key
        for key, f in fields.items()
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    problems.extend(f"{_key(path, key)}: required" for key in missing if key not in bad)
    if missing:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{path or 'config'}: {exc}")
        return None


def _yaml11_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def overrides_applied(
    schema_type: type, data: dict[str, Any], overrides: list[str]
) -> dict[str, Any]:
    """A copy of `data` (a config of dataclass `schema_type`) with each ``a.b=c`` set: data[a][b]
    becomes c, parsed as YAML (so 3 is an int and [1, 2] a list).

    A section written as a bare name (``precision: int4-qat``) or left null (``lora: null``)
    opens into a mapping on the way down, so ``precision.group_size=32`` sets that component's
    option whichever way its section was written."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"--set {item!r}: expected key.path=value"])
        *parents, leaf = key.split(".")
        node, schema = out, _section_type(schema_type)
        for i, part in enumerate(parents):
            schema = _field_type(schema, part)
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                shorthand = getattr(schema, "__shorthand__", None)
                if shorthand is None or not isinstance(child, str | int | float):
                    where = ".".join(parents[: i + 1])
                    raise ConfigError([f"--set {item!r}: {where} is {child!r}, not a section"])
                child = {shorthand: child}
            node[part] = child
            node = child
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


def _section_type(tp: Any) -> type | None:
    """The dataclass a key's type names (``ComponentRef | None`` -> ComponentRef), or None."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    found = [o for o in options if dataclasses.is_dataclass(o)]
    return typing.cast(type, found[0]) if found else None


def _field_type(cls: type | None, key: str) -> type | None:
    """The section type of `key` inside section `cls` (None: not a known section)."""
    if cls is None:
        return None
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("key", f.name) == key and f.name != getattr(cls, "__options__", None):
            return _section_type(hints[f.name])
    return None
