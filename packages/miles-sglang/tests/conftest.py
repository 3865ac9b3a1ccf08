"""`miles serve` as a real process on 127.0.0.1, driven over real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from miles.runtime.cluster.process import free_port


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def call(
        self, path: str, body: Any = None, method: str | None = None, raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:  # fmt: skip
        """(status, parsed JSON or text) of one HTTP call."""
        from miles.sglang.serve_keys import key_for_url

        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        key = key_for_url(self.url)  # the key the server made (none with --api-key)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method or ("GET" if data is None else "POST"),
            headers={"Content-Type": "application/json", **auth, **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text


def start_server(
    model: str,
    tmp: Path,
    *args: str,
    port: int | None = None,
    slow: float = 0.0,
    full_length: bool = False,
) -> Server:
    """`miles serve MODEL ARGS` on `port`; `slow`: its engine steps take at least this many
    seconds; `full_length`: every answer runs to max_new_tokens (slow_serve.py)."""
    port = port or free_port()
    log = tmp / f"serve-{port}.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILES_TEST_STEP_DELAY_S": str(slow),
        "MILES_TEST_FULL_LENGTH": "1" if full_length else "0",
    }
    test_server = slow or full_length
    cli = (
        [str(Path(__file__).parent / "slow_serve.py")] if test_server else ["-m", "miles.core.cli"]
    )
    process = subprocess.Popen(
        [sys.executable, *cli, "serve", model, "--port", str(port), *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    server = Server(f"http://127.0.0.1:{port}", model, process, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"miles serve exited {process.returncode}:\n{log.read_text()}")
        try:
            if server.call("/health")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"miles serve did not come up:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from miles.torch.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab_size=128)


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(model, tmp_path_factory.mktemp("serve"))
    yield started
    stop_server(started)


@pytest.fixture
def serve_process() -> tuple[Any, Any]:
    """(start_server, stop_server), for a test that starts its own server."""
    return start_server, stop_server


@pytest.fixture(scope="module")
def serve_process_for_module() -> tuple[Any, Any]:
    """(start_server, stop_server), for a module's own server fixture."""
    return start_server, stop_server


# -- real chat templates on tiny tokenizers ------------------------------------------------------

_TEMPLATES = Path(__file__).parent / "chat_templates"  # README.md there says where each is from
# (special tokens, other added tokens) of each family's tokenizer.
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_ADDED = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_DEEPSEEK_NAMES = ["begin▁of▁sentence", "end▁of▁sentence", "User", "Assistant", "tool▁sep"] + [
    f"tool▁{kind}▁{end}"
    for kind in ("calls", "call", "outputs", "output")
    for end in ("begin", "end")
]
_QWEN = (_QWEN_SPECIAL, _QWEN_ADDED)
_DEEPSEEK = (tuple(f"<｜{name}｜>" for name in _DEEPSEEK_NAMES), ("<think>", "</think>"))


def make_chat_tokenizer(template: str) -> Any:
    """A character-level tokenizer (as `miles.torch.testing`'s) with the tokens and chat template
    of a real model family: `qwen3`, `qwen3_5` or `deepseek_r1` (chat_templates/NAME.jinja), or
    `chatml` (the tiny test models' template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from miles.torch.testing import CHAT_TEMPLATE

    special, added = _DEEPSEEK if template.startswith("deepseek") else _QWEN
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*special, *added, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[0]))
    # One pre-token per character, newlines too (a run of them must not become one unknown).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special))
    tok.add_tokens(list(added))
    text = CHAT_TEMPLATE if template == "chatml" else (_TEMPLATES / f"{template}.jinja").read_text()
    if template.startswith("deepseek"):
        names = {"bos_token": special[0], "eos_token": special[1], "pad_token": special[1]}
    else:
        names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token=special[0], chat_template=text, **names
    )


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    """`chat_tokenizer(template)`: `make_chat_tokenizer`, made once per template."""
    made: dict[str, Any] = {}

    def get(template: str) -> Any:
        if template not in made:
            made[template] = make_chat_tokenizer(template)
        return made[template]

    return get
