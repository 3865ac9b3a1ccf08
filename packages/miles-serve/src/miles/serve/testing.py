"""`miles serve` as a real process on 127.0.0.1, driven over real HTTP: for tests of the server and
of its clients (the sglang rollout backend, agents), here and in plugins. Run as a module, it is a
`miles serve` whose engine is slowed (`slow_engine`), for tests of requests in flight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.runtime.cluster.process import free_port
from miles.sglang.serve_keys import key_for_url


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
    seconds; `full_length`: every answer runs to max_new_tokens (`slow_engine`)."""
    port = port or free_port()
    log = tmp / f"serve-{port}.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILES_TEST_STEP_DELAY_S": str(slow),
        "MILES_TEST_FULL_LENGTH": "1" if full_length else "0",
    }
    cli = ["-m", "miles.serve.testing" if slow or full_length else "miles.core.cli"]
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


def slow_engine() -> None:
    """Patches the torch engine, in this process, the way `start_server(slow=..., full_length=...)`
    asks through MILES_TEST_STEP_DELAY_S and MILES_TEST_FULL_LENGTH: every model step takes at
    least the delay, as a larger model's would (a batch then outlasts a train step of the tiny test
    model, so a weight update reliably finds requests in flight), one token per step as SGLang's
    scheduler decodes; and with full length an end-of-sequence token does not end an answer (only
    max_new_tokens does), as with SGLang's ignore_eos."""
    from miles.torch.engine.engine import TorchRolloutEngine
    from miles.torch.engine.paged.runner import PagedRunner

    delay = float(os.environ.get("MILES_TEST_STEP_DELAY_S", "0.05"))
    step = PagedRunner.step

    def slow_step(self: PagedRunner) -> None:
        time.sleep(delay)
        step(self)

    PagedRunner.step = slow_step  # type: ignore[method-assign]
    PagedRunner._burst_length = lambda self, seqs: 1  # type: ignore[method-assign]
    if os.environ.get("MILES_TEST_FULL_LENGTH") == "1":
        finish_reason = TorchRolloutEngine._finish_reason

        def length_only(self: TorchRolloutEngine, row: Any) -> str | None:
            reason = finish_reason(self, row)
            return None if reason == "stop" else reason

        TorchRolloutEngine._finish_reason = length_only  # type: ignore[method-assign]


if __name__ == "__main__":  # `python -m miles.serve.testing serve MODEL ...`: a slowed server
    from miles.core.cli import main

    slow_engine()
    main()
