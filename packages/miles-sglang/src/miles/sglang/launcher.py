"""A server launched by its engine: one SGLang (or `miles serve`) process per rollout engine, on
the engine actor's GPUs, bound to 127.0.0.1 on a free port, under `miles.sglang.supervise` so it
never outlives the actor.

SGLang gets what Miles' rollout needs (`--tp-size` = the actor's GPUs, `--random-seed`, `--dtype`,
`--enable-return-routed-experts` with routing replay, `--skip-server-warmup`) and then
`rollout.server_args`, passed through as flags (`{mem_fraction_static: 0.8}` ->
`--mem-fraction-static 0.8`; `true` -> the bare flag), so any of its options can be set.
Ready is `/health_generate` answering 200, as SGLang's own launchers wait for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.contracts.backends import RolloutSetup
from miles.runtime.cluster.process import free_port
from miles.sglang.config import SGLangConfig


class LaunchFailed(RuntimeError):
    """The server exited or did not become ready in time; the message has its log's tail."""


def flags(args: dict[str, Any]) -> list[str]:
    """`server_args` as command-line flags."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def server_command(config: SGLangConfig, setup: RolloutSetup, port: int) -> list[str]:
    """The command line of engine `setup.index`'s server."""
    dtype = str(setup.precision.rollout_dtype).removeprefix("torch.")
    routes = setup.record_routing != "off"
    if config.server == "miles":
        command = [
            sys.executable, "-m", "miles.core.cli", "serve", setup.model_path,
            "--host", "127.0.0.1", "--port", str(port),
            "--device", setup.device, "--dtype", dtype, "--seed", str(setup.seed),
        ]  # fmt: skip
        if routes:
            command.append("--record-routing")
    else:
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", setup.model_path,
            "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(len(gpus.split(",")) if gpus else 1),
            "--random-seed", str(setup.seed), "--dtype", dtype, "--skip-server-warmup",
        ]  # fmt: skip
        if routes:
            command.append("--enable-return-routed-experts")
    return command + flags(config.server_args)


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, config: SGLangConfig, setup: RolloutSetup) -> LaunchedServer:
        port = free_port()
        if setup.run_dir:  # beside the run's other files: run_dir/servers/engine0-PORT.log
            log_dir = Path(setup.run_dir) / "servers"
            log_dir.mkdir(parents=True, exist_ok=True)
            log_name = str(log_dir / f"engine{setup.index}-{port}.log")
            fd = os.open(log_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            fd, log_name = tempfile.mkstemp(prefix=f"miles-engine{setup.index}-", suffix=".log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if setup.cpu_threads:  # this engine's share of the machine's cores
            env["OMP_NUM_THREADS"] = str(setup.cpu_threads)
        supervised = [sys.executable, "-m", "miles.sglang.supervise", "--"]
        with os.fdopen(fd, "wb") as log:
            process = subprocess.Popen(
                supervised + server_command(config, setup, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        server = cls(f"http://127.0.0.1:{port}", process, Path(log_name))
        server.wait_ready(config.startup_timeout_s)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LaunchFailed(
                    f"the server of {self.url} exited with code {self.process.returncode} "
                    f"before it was ready; its log ({self.log}) ends:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise LaunchFailed(
            f"the server of {self.url} was not ready within rollout.startup_timeout_s="
            f"{timeout_s:g}; its log ({self.log}) ends:\n{self.tail()}"
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()  # the supervisor stops the server's process group
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
