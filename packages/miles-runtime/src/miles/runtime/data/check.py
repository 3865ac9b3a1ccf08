"""The run's datasets, read once before anything starts: every bad row as `file:line: what`.

`miles run` used to find a malformed line, a missing or null prompt, bytes that are not UTF-8 or
a prompt longer than the model's context only after Ray and the actors had started, some only
when their batch came up, under Ray's traceback. Here each JSONL file the run reads is streamed
once, row by row, before launch. Only a prompt that might not fit is tokenized: a token covers
at least one byte, so a prompt of fewer bytes than the context (with room for the chat template)
fits without being tokenized, and large files of ordinary rows stay fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.core.config import ConfigError, RunConfig
from miles.core.contracts.components import Kind
from miles.core.contracts.family import text_config
from miles.core.registry.factory import options_with_defaults
from miles.core.registry.families import model_config
from miles.runtime.data.source import rows_with_lines

# Tokens a chat template may add around a prompt (and a system prompt), for the byte bound.
TEMPLATE_ALLOWANCE = 512

Encode = Callable[[list[dict[str, Any]]], list[list[int]]]


@dataclass(frozen=True)
class Field:
    """A row field the run reads: its key, the config key that names it, and whether it is a
    prompt (text, or chat messages) whose length must fit the context."""

    key: str
    config_key: str
    prompt: bool = False


@dataclass
class FileReport:
    path: str
    rows: int = 0
    problems: list[str] = field(default_factory=list)
    # (line, tokens) of the prompts longer than the context
    too_long: list[tuple[int, int]] = field(default_factory=list)


def prompt_bytes(value: Any) -> int:
    """UTF-8 bytes of a prompt's text (a string, or chat messages' contents)."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, list):
        return sum(prompt_bytes(m.get("content", "") if isinstance(m, dict) else m) for m in value)
    return len(str(value).encode("utf-8"))


def _field_problem(row: dict[str, Any], f: Field) -> str | None:
    if f.key not in row:
        shown = ", ".join(sorted(row)[:8]) + (", ..." if len(row) > 8 else "")
        return f"no {f.key!r} field (fields: {shown}); set {f.config_key}"
    value = row[f.key]
    if value is None:
        return f"{f.key!r} is null"
    if f.prompt and not isinstance(value, str | list):
        name = type(value).__name__
        article = "an" if name[0] in "aeiou" else "a"
        return f"{f.key!r} is {article} {name}: expected text or a list of chat messages"
    if (
        f.prompt
        and isinstance(value, list)
        and not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
    ):
        return f"{f.key!r}: chat messages must be objects with a text 'content'"
    return None


def too_long(
    rows: Sequence[dict[str, Any]],
    key: str,
    encode: Encode,
    context: int,
    extra_bytes: int = 0,
) -> dict[int, int]:
    """{index: tokens} of the rows whose `key` prompt, tokenized by `encode` (chat template
    included), is longer than `context`; only prompts of more than `context -
    TEMPLATE_ALLOWANCE - extra_bytes` bytes are tokenized."""
    bound = context - TEMPLATE_ALLOWANCE - extra_bytes
    candidates = [i for i, row in enumerate(rows) if prompt_bytes(row.get(key)) > bound]
    if not candidates:
        return {}
    ids = encode([rows[i] for i in candidates])
    return {i: len(t) for i, t in zip(candidates, ids, strict=True) if len(t) > context}


def check_file(
    path: str,
    fields: Sequence[Field],
    *,
    context: int | None,
    encode: Callable[[str], Encode] | None = None,
    extra_bytes: int = 0,
) -> FileReport:
    """Every row of the JSONL file `path`: its fields, and its prompts' tokens against `context`
    (None: not checked), tokenized by `encode(key)` as the run will (see `too_long`)."""
    report = FileReport(path)
    good: list[tuple[int, dict[str, Any]]] = []
    for lineno, row in rows_with_lines(path):
        if isinstance(row, str):
            report.problems.append(f"{path}:{lineno}: {row}")
            continue
        report.rows += 1
        problems = [p for f in fields if (p := _field_problem(row, f))]
        report.problems += [f"{path}:{lineno}: {p}" for p in problems]
        if not problems:
            good.append((lineno, row))
    if not report.rows and not report.problems:
        report.problems.append(f"{path}: no rows")
    if context is not None and encode is not None:
        for f in (f for f in fields if f.prompt):
            long = too_long([row for _, row in good], f.key, encode(f.key), context, extra_bytes)
            report.too_long += [(good[i][0], n) for i, n in sorted(long.items())]
    return report


# Rows listed in the error before the rest are only counted.
MAX_LISTED = 40


def _line_of(problem: str) -> int:
    """The line number of a `file:line: what` problem (0 for a whole-file one), for sorting."""
    parts = problem.split(":", 2)
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0


def _is_local_jsonl(path: str | None) -> bool:
    return bool(path) and str(path).endswith((".jsonl", ".json")) and Path(str(path)).is_file()


def model_context(config: RunConfig) -> int | None:
    """Positions the model holds (its config's max_position_embeddings), None if unknown."""
    found = model_config(config.model.path)
    if found is None:
        return None
    positions = text_config(found[0]).get("max_position_embeddings")
    return int(positions) if isinstance(positions, int) and positions > 0 else None


def _answer_field(config: RunConfig) -> Field | None:
    options = options_with_defaults(Kind.REWARD, config.reward.name, dict(config.reward.options))
    key = options.get("answer_key")
    return Field(key, "reward.answer_key") if isinstance(key, str) and key else None


def check_run_data(config: RunConfig, encode_for: Callable[[str], Encode]) -> dict[str, int]:
    """Checks every local JSONL file the run reads (prompts, evaluation, warm start) before
    launch; ConfigError listing each bad row. Prompts longer than the model's context are
    problems too, unless `data.drop_long_prompts`: then {path: rows dropped} (the rollout
    manager drops the same rows). Parquet files and hub datasets are read by `datasets` at
    launch and not checked here."""
    context = model_context(config)
    prompt = Field(config.data.prompt_key, "data.prompt_key", prompt=True)
    answer = _answer_field(config)
    files: list[tuple[str, list[Field], bool]] = [
        (config.data.path, [prompt, *([answer] if answer else [])], True),
    ]
    if config.eval.data:
        files.append((config.eval.data, [prompt, *([answer] if answer else [])], True))
    ws = config.warmstart
    if ws.steps and ws.data:
        files.append(
            (
                ws.data,
                [
                    Field(ws.prompt_key, "warmstart.prompt_key", prompt=True),
                    Field(ws.response_key, "warmstart.response_key"),
                ],
                False,
            )
        )
    extra = len((config.data.system_prompt or "").encode("utf-8"))
    problems: list[str] = []
    dropped: dict[str, int] = {}
    for path, fields, droppable in files:
        if not _is_local_jsonl(path):
            continue
        report = check_file(path, fields, context=context, encode=encode_for, extra_bytes=extra)
        found = list(report.problems)
        if report.too_long and droppable and config.data.drop_long_prompts:
            dropped[path] = len(report.too_long)
            if len(report.too_long) == report.rows:
                found.append(f"{path}: every prompt is longer than the model's context")
        else:
            found += [
                f"{path}:{line}: the prompt is {tokens} tokens, more than the model's context "
                f"of {context} (set data.drop_long_prompts: true to drop such rows)"
                for line, tokens in report.too_long
            ]
        problems += sorted(found, key=_line_of)
    if problems:
        listed = problems[:MAX_LISTED]
        if len(problems) > MAX_LISTED:
            listed.append(f"... and {len(problems) - MAX_LISTED} more rows")
        raise ConfigError(listed)
    return dropped
