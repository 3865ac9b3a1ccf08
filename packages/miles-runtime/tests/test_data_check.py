"""The pre-launch dataset check (`miles.runtime.data.check`): every bad row as `file:line: what`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.runtime.data.check import Field, check_file, too_long

PROMPT = Field("prompt", "data.prompt_key", prompt=True)
ANSWER = Field("answer", "reward.answer_key")


def _write(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _chars(key: str):
    """A stand-in tokenizer: one token per character (the real one is the run's PromptEncoder)."""

    def encode(rows: list[dict[str, Any]]) -> list[list[int]]:
        calls.append(len(rows))
        return [[0] * len(str(r[key])) for r in rows]

    return encode


calls: list[int] = []


def test_every_bad_row_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "fine", "answer": "1"}).encode(),
            b'{"prompt": "cut short", ',
            b"",  # blank lines are skipped, not counted
            json.dumps({"question": "q", "answer": "1"}).encode(),
            json.dumps({"prompt": None, "answer": "1"}).encode(),
            b'{"prompt": "caf\xe9", "answer": "1"}',
            json.dumps({"prompt": 7, "answer": "1"}).encode(),
            json.dumps({"prompt": [{"role": "user"}], "answer": "1"}).encode(),
            json.dumps({"prompt": "fine", "answer": None}).encode(),
            b"[1, 2]",
        ],
    )
    report = check_file(path, [PROMPT, ANSWER], context=None)
    assert report.problems == [
        f"{path}:2: not valid JSON: Expecting property name enclosed in double quotes (column 25)",
        f"{path}:4: no 'prompt' field (fields: answer, question); set data.prompt_key",
        f"{path}:5: 'prompt' is null",
        f"{path}:6: not UTF-8: byte 0xe9 at column 16",
        f"{path}:7: 'prompt' is an int: expected text or a list of chat messages",
        f"{path}:8: 'prompt': chat messages must be objects with a text 'content'",
        f"{path}:9: 'answer' is null",
        f"{path}:10: a JSON list, not an object",
    ]
    assert report.rows == 6  # the JSON objects


def test_only_prompts_that_may_not_fit_are_tokenized(tmp_path: Path) -> None:
    rows = [{"prompt": "a" * n} for n in (10, 600, 2000, 3000)]
    path = _write(tmp_path / "d.jsonl", [json.dumps(r).encode() for r in rows])
    calls.clear()
    report = check_file(path, [PROMPT], context=2048, encode=_chars)
    # 2048 - 512 (template allowance) bytes: the 2000 and 3000 ones are tokenized, one is long
    assert calls == [2]
    assert report.too_long == [(4, 3000)] and report.problems == []
    assert too_long(rows, "prompt", _chars("prompt"), 2048) == {3: 3000}
    assert too_long(rows, "prompt", _chars("prompt"), 2048, extra_bytes=1500) == {3: 3000}
    assert calls[-1] == 3  # a long system prompt lowers the bound: 600 is tokenized too


def test_an_empty_file_is_a_problem(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [b""])
    assert check_file(path, [PROMPT], context=None).problems == [f"{path}: no rows"]
