"""`miles plugins new reward NAME`: a ready-to-publish reward plugin package.

Naming: NAME is the reward's name, lowercase letters and digits in words joined by ``-`` or ``_``
(``math-verify``). It gives

* the distribution ``miles-reward-NAME`` (``_`` written as ``-``): what ``pip install`` takes;
* the module ``miles_reward_NAME`` (``-`` written as ``_``), under ``src/``;
* the reward and its entry point ``NAME`` with ``_`` (``math_verify``): what run configs use.

A NAME already starting with ``miles-reward-`` has that prefix dropped. The files come from the
``templates/reward`` folder shipped in this package (miles-plugin-kit); ``{{key}}`` placeholders
are filled in.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from miles.core import __version__ as core_version
from miles.plugin_kit import __version__ as kit_version

_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
_MAX_NAME = 40
_PREFIXES = ("miles-reward-", "miles_reward_")
# Template file names: `__module__` is the package folder, `.tmpl` keeps tools from reading
# templates as code (pytest would collect tests/test_reward.py), `gitignore` becomes `.gitignore`.
_RENAMES = {"gitignore": ".gitignore"}


class ScaffoldError(ValueError):
    """A NAME or destination the scaffolder refuses; the message says why and what to do."""


@dataclass(frozen=True)
class RewardNames:
    """Every name derived from NAME."""

    reward: str  # component and entry-point name: math_verify
    dist: str  # distribution: miles-reward-math-verify
    module: str  # import package: miles_reward_math_verify
    cls: str  # class-name stem: MathVerify

    @classmethod
    def parse(cls, name: str) -> RewardNames:
        raw = name.strip()
        for prefix in _PREFIXES:
            if raw.lower().startswith(prefix):
                raw = raw[len(prefix) :]
        if raw != raw.lower() and _NAME.fullmatch(raw.lower()):
            raise ScaffoldError(
                f"invalid reward name {name!r}: use lowercase, e.g. {raw.lower()!r}"
            )
        if not _NAME.fullmatch(raw):
            raise ScaffoldError(
                f"invalid reward name {name!r}: use lowercase letters and digits, starting with a "
                "letter, in words joined by '-' or '_' (e.g. 'math-verify')"
            )
        if len(raw) > _MAX_NAME:
            raise ScaffoldError(f"reward name {name!r} is longer than {_MAX_NAME} characters")
        words = re.split(r"[-_]", raw)
        return cls(
            reward="_".join(words),
            dist="miles-reward-" + "-".join(words),
            module="miles_reward_" + "_".join(words),
            cls="".join(w.capitalize() for w in words),
        )


def _series(version: str, dist: str) -> str:
    """The version range of ``version``'s series: before 1.0 a minor release may break plugins
    (``0.1.0`` gives ``>=0.1,<0.2``); from 1.0, a major release (``1.4.2`` gives ``>=1.4,<2``)."""
    try:
        v = Version(version)
    except InvalidVersion as exc:
        raise ScaffoldError(f"cannot derive a {dist} range from version {version!r}") from exc
    upper = f"{v.major}.{v.minor + 1}" if v.major == 0 else f"{v.major + 1}"
    return f">={v.major}.{v.minor},<{upper}"


def core_range(version: str = core_version) -> str:
    """The miles-core range a new plugin declares: the running core's series."""
    return _series(version, "miles-core")


def kit_range(version: str = kit_version) -> str:
    """The miles-plugin-kit range of a new plugin's `test` extra (its tests import the checks):
    the running kit's series."""
    return _series(version, "miles-plugin-kit")


def _template_root() -> Traversable:
    return resources.files("miles.plugin_kit") / "templates" / "reward"


def _walk(folder: Traversable, rel: Path = Path()) -> Iterable[tuple[Path, Traversable]]:
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__":
            continue
        if entry.is_dir():
            yield from _walk(entry, rel / entry.name)
        elif entry.name.endswith(".tmpl"):
            yield rel / entry.name.removesuffix(".tmpl"), entry


def render(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{(\w+)\}\}", template)
    if left:
        raise ScaffoldError(f"template placeholders without a value: {sorted(set(left))}")
    return template


def scaffold_reward(
    name: str, dest: Path | None = None, *, taken: Iterable[str] = ()
) -> tuple[RewardNames, Path]:
    """Writes the package for reward NAME into ``dest`` (default ``./miles-reward-NAME``).

    ``taken`` are reward names already registered here, which a new one must not reuse. Refuses an
    existing, non-empty ``dest``; writes into a temporary folder first, so a failure leaves nothing.
    """
    names = RewardNames.parse(name)
    if names.reward in set(taken):
        raise ScaffoldError(
            f"a reward named {names.reward!r} is already installed (see `miles components list "
            "--kind reward`); pick another name, or a prefix such as 'acme-'"
        )
    dest = (dest if dest is not None else Path.cwd() / names.dist).resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ScaffoldError(f"{dest} already exists; not overwriting it (pick another --dir)")
    values = {
        "reward": names.reward,
        "dist": names.dist,
        "module": names.module,
        "cls": names.cls,
        "core_range": core_range(),
        "kit_range": kit_range(),
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling (same file system, so the final rename is atomic), made with the umask's mode.
    staging = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    staging.mkdir()
    try:
        for rel, entry in _walk(_template_root()):
            parts = [_RENAMES.get(p, p).replace("__module__", names.module) for p in rel.parts]
            target = staging.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(render(entry.read_text(encoding="utf-8"), values), encoding="utf-8")
        if dest.exists():
            dest.rmdir()  # empty, checked above
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return names, dest
