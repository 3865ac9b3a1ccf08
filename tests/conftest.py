"""Shared fixtures for the cross-package tests: tiny real checkpoints and `miles run` in a subprocess."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

MILES = [sys.executable, "-m", "miles.core.cli"]


# A graded reward for random tiny models, used by import path (no plugin needed for one-off code):
# exact match would score every sample 0, leaving no advantage and so no gradient to compare.
REWARD_MODULE = '''
async def vowel_fraction(response, sample):
    """Fraction of the response's characters that are vowels."""
    return sum(c in "aeiou" for c in response) / max(len(response), 1)


async def char_count(response, sample):
    """Up to 16 characters, 1/16 each: graded, so random tiny models get advantages."""
    return min(len(response), 16) / 16


async def slow_vowels(response, sample):
    """vowel_fraction, a second late: a step that takes long enough to be interrupted in."""
    import asyncio

    await asyncio.sleep(1.0)
    return await vowel_fraction(response, sample)


async def flaky(response, sample):
    """Raises for every other sample: a reward with a bug."""
    if sample.sample_id % 2:
        raise RuntimeError("flaky reward bug")
    return 1.0
'''
# A third-party loss plugin, installed the way pip leaves one (module + .dist-info with its entry
# point), to prove a loss from outside the project is usable by name.
LOSS_PLUGIN = '''
from dataclasses import dataclass

from miles.core import ComponentSpec, Kind, hookimpl


@dataclass
class ScaledPGConfig:
    scale: float = 1.0


class ScaledPG:
    """REINFORCE: -scale * A * logp per token."""

    def __init__(self, config):
        self.config = config

    def __call__(self, inputs):
        return -self.config.scale * inputs.advantages * inputs.logprobs, {}


@hookimpl
def miles_register_losses():
    return [ComponentSpec(Kind.LOSS, "scaled_pg", ScaledPG, "REINFORCE, scaled", ScaledPGConfig)]
'''
# Fault injection for the chaos tests: the real torch engine and FSDP trainer, which fail once at
# a chosen point. A marker file (created exclusively) makes the fault happen exactly once per run,
# whichever actor gets there first; restarted actors then behave.
CHAOS_PLUGIN = '''
import os
import threading
import time
from dataclasses import dataclass, replace

import ray

from miles.core import hookimpl
from miles.torch import plugin
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.train.config import FSDPConfig


def _claim(marker):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _die():
    """ray.kill this very actor, as an operator (or a preempting scheduler) would."""
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    time.sleep(3600)


@dataclass
class ChaosEngineConfig(TorchEngineConfig):
    fault: str = "none"  # kill | hang
    at_call: int = 2  # the generate call (in this process) that fails, after its first result
    marker: str = ""
    step_delay_s: float = 0.0  # a slow engine: this long per model step
    kill_at_receive: int = 0  # the receive_weights call (in this process) that dies; 0: none
    # The receive_weights call (in this process) after which one weight tensor is changed (a real
    # change, which the engine's checksum sees); 0: none. Generating from such weights writes
    # MARKER.generated-corrupt.
    corrupt_at_receive: int = 0


def make_engine(config, setup):
    from miles.torch.plugin import make_engine as make_torch_engine

    engine = make_torch_engine(config, setup)

    class ChaosEngine(type(engine)):
        calls = 0
        corrupted = False

        def generate(self, requests):
            if ChaosEngine.corrupted:
                open(config.marker + ".generated-corrupt", "w").close()
            inner = super().generate(requests)
            ChaosEngine.calls += 1
            if config.fault == "none" or ChaosEngine.calls != config.at_call:
                return inner
            if not _claim(config.marker):
                return inner
            return self._failing(inner)

        def _step(self, batch, pending):
            time.sleep(config.step_delay_s)
            return super()._step(batch, pending)

        def receive_weights(self, plan, version):
            ChaosEngine.receives = getattr(ChaosEngine, "receives", 0) + 1
            if ChaosEngine.receives == config.kill_at_receive and _claim(config.marker):
                _die()  # the trainer is broadcasting to it
            super().receive_weights(plan, version)
            ChaosEngine.corrupted = False  # every weight was just received
            if ChaosEngine.receives == config.corrupt_at_receive and _claim(config.marker):
                import torch

                with self._lock, torch.no_grad():
                    next(self.model.parameters()).add_(0.5)
                ChaosEngine.corrupted = True

        def _failing(self, inner):
            yield next(inner)[:1]  # one request finishes, the others are mid-generation
            if config.fault == "kill":
                _die()
            threading.Event().wait()  # hang: never return, never raise

    engine.__class__ = ChaosEngine  # the torch engine, failing on cue
    return engine


@dataclass
class ChaosFSDPConfig(FSDPConfig):
    kill_at_train_step: int = 0  # the train_step call (in this process) that dies; 0: none
    marker: str = ""
    step_delay_s: float = 0.0  # a slow trainer: this long per train_step


def make_trainer(config, setup):
    from miles.torch.train.fsdp import FSDPTrainer

    class ChaosTrainer(FSDPTrainer):
        calls = 0

        def train_step(self, batch, loss):
            time.sleep(config.step_delay_s)
            ChaosTrainer.calls += 1
            if ChaosTrainer.calls == config.kill_at_train_step and _claim(config.marker):
                _die()
            return super().train_step(batch, loss)

    return ChaosTrainer(config, setup)


@hookimpl
def miles_register_rollout_backends():
    torch = plugin.miles_register_rollout_backends()[0]
    return [replace(torch, name="chaos_torch", factory=make_engine, config=ChaosEngineConfig)]


@hookimpl
def miles_register_train_backends():
    fsdp = plugin.miles_register_train_backends()[0]
    return [replace(fsdp, name="chaos_fsdp", factory=make_trainer, config=ChaosFSDPConfig)]
'''
# A third-party model family plus a recipe that uses it: Llama, which Miles itself does not cover.
FAMILY_PLUGIN = """
from miles.core import ComponentSpec, Kind, hookimpl
from miles.core.contracts.family import ModelFamily, ModelShape, ParallelHints, ParamCounts
from miles.core.contracts.recipe import Recipe


def shape(config):
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    attention = h * heads * hd * 2 + 2 * h * kv * hd
    per_layer = attention + 3 * h * inter + 2 * h
    tied = config.get("tie_word_embeddings", False)
    return ModelShape(
        params=ParamCounts(vocab * h, 0 if tied else vocab * h, layers * per_layer, other=h),
        num_layers=layers,
        hidden_size=h,
        vocab_size=vocab,
        active_expert_params=0,
        kv_elems_per_token=layers * 2 * kv * hd,
        state_elems_per_seq=0,
        act_elems_per_token=layers * (4 * h + 3 * inter),
    )


def tiny():
    return {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "initializer_range": 0.1}


def my_llama():
    return ModelFamily("my_llama", ("llama",), shape=shape, tiny=tiny,
                       parallel=lambda c: ParallelHints((("num_attention_heads", 4),)))


def llama_quickstart():
    from miles.recipes.quickstart import CONFIG, PREPARES, prepare

    config = {**CONFIG, "name": "llama-quickstart", "model": {"family": "my_llama"}}
    return Recipe(config=config, prepare=prepare, prepares=PREPARES)


@hookimpl
def miles_register_families():
    return [ComponentSpec(Kind.FAMILY, "my_llama", my_llama, "Llama, from a user plugin")]


@hookimpl
def miles_register_recipes():
    return [ComponentSpec(Kind.RECIPE, "llama-quickstart", llama_quickstart,
                          "the quickstart task on the user's Llama family")]
"""
TEST_MODULES = Path(__file__).parent / "_modules"


def install_plugin(name: str, source: str) -> None:
    """Puts module `miles_test_<name>` and its dist-info (an entry point in the `miles` group) in
    TEST_MODULES, as pip would leave distribution `miles-test-<name>`; run_miles puts that
    directory on the subprocess's path."""
    module, dist = f"miles_test_{name}", f"miles-test-{name.replace('_', '-')}"
    TEST_MODULES.mkdir(exist_ok=True)
    _write(TEST_MODULES / f"{module}.py", source)
    info = TEST_MODULES / f"{module}-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    _write(
        info / "METADATA",
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n"
        "Requires-Dist: miles-core>=0.1,<0.2\n",
    )
    _write(info / "entry_points.txt", f"[miles]\n{name} = {module}\n")


def _write(path: Path, text: str) -> None:
    """Writes `text` unless the file holds it already, atomically: another test worker may be
    starting a run that reads it."""
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ── one Ray per test worker ──────────────────────────────────────────────────────────────────────
# Started on first use and stopped when the worker exits; `miles run` joins it with --ray-address.
# Its workers see the environment it was started with: the test plugins' path, token auth.
_shared_ray: tuple[str, subprocess.Popen[str]] | None = None
_shared_ray_lock = threading.Lock()  # runs started from several threads start one Ray
SHARED_RAY_CPUS = 8  # room for a run's train ranks and engines, and one still winding down


def shared_ray() -> str:
    """The address of this test process's Ray, started now if it is not up yet."""
    with _shared_ray_lock:
        if _shared_ray is None or _shared_ray[1].poll() is not None:
            _start_shared_ray()
        assert _shared_ray is not None
        return _shared_ray[0]


def _start_shared_ray() -> None:
    global _shared_ray
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_test_env(), "RAY_AUTH_MODE": "token"}
    ray = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen(
        [
            str(ray), "start", "--head", "--block", f"--port={port}",
            f"--num-cpus={SHARED_RAY_CPUS}", "--num-gpus=0", "--include-dashboard=false",
            "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            # `miles run` reads no actor output through Ray (log_to_driver is off): the monitor
            # that tails every worker's log for drivers would cost CPU for no reader.
            "--include-log-monitor=false",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # stopped with its whole process group, never `ray stop`
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        seen.append(line)
        if "Ray runtime started" in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    else:
        raise RuntimeError(f"ray start failed:\n{''.join(seen)}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    atexit.register(_stop_shared_ray, proc)
    _shared_ray = (f"127.0.0.1:{port}", proc)


def _stop_shared_ray(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _test_env() -> dict[str, str]:
    """The environment of a run (and of the shared Ray): the test plugins, written into
    TEST_MODULES now, on its PYTHONPATH."""
    TEST_MODULES.mkdir(exist_ok=True)
    _write(TEST_MODULES / "miles_test_rewards.py", REWARD_MODULE)
    install_plugin("loss_plugin", LOSS_PLUGIN)
    install_plugin("chaos", CHAOS_PLUGIN)
    install_plugin("family", FAMILY_PLUGIN)
    pythonpath = os.pathsep.join(filter(None, [str(TEST_MODULES), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "CI": "1", "RAY_DEDUP_LOGS": "0", "PYTHONPATH": pythonpath}


def run_miles(
    *args: str,
    cwd: Path | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`miles ARGS` in a subprocess (its own process group, so Ray's processes end with it). Past
    `timeout` the test fails with the stacks of the CLI's threads (it dumps them on SIGUSR1).

    `miles run` joins this test worker's Ray (`shared_ray`, as `--ray-address` joins a cluster)
    instead of starting a Ray of its own (a two-step run: 9.6 s against 13.3 s). A run given `env`
    starts its own (a Ray that is already up does not see a run's environment), as does one
    with its own `--ray-address`."""
    joins = args[:1] == ("run",) and not (env or "--ray-address" in args)
    env = {**_test_env(), **(env or {})}
    if joins:
        args = (*args, "--ray-address", shared_ray())
        env["RAY_AUTH_MODE"] = "token"
    proc = subprocess.Popen(
        [*MILES, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    hung = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.kill(proc.pid, signal.SIGUSR1)  # the stacks of every thread, to its stderr
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:  # the test itself was stopped (its time limit, Ctrl-C)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if hung:
        pytest.fail(f"miles {' '.join(args)}: no end after {timeout}s\n{err[-12000:]}", False)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Callable[..., Path]:
    """`shared_runs(NAME, *ARGS)`: the run directory of `miles run ARGS`, made once per test
    session by whichever test worker asks first (the others wait for it, then read it), for an
    uninterrupted run that tests in several files read. A failed run fails every test that asks
    for it, with its output, without running again."""
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(name: str, *args: str, timeout: int = 600) -> Path:
        run_dir = root / name
        done, failed = root / f"{name}.done", root / f"{name}.failed"
        with (root / f"{name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.exists() and not failed.exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                proc = run_miles("run", *args, "--run-dir", str(run_dir), timeout=timeout)
                (failed if proc.returncode else done).write_text(proc.stderr)
        if failed.exists():
            pytest.fail(f"the shared run {name!r} failed:\n{failed.read_text()[-4000:]}", False)
        return run_dir

    return get


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny Qwen3 checkpoint (random weights, written now) and a small prompt set."""
    from miles.torch.testing import make_tiny_model

    root = tmp_path_factory.mktemp("assets")
    model = make_tiny_model(root / "model", arch="qwen3", vocab_size=128, seed=0)
    rows = [{"prompt": f"say {c}", "answer": c} for c in "abcdefghijkl"]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "data": str(data)}


def write_config(path: Path, assets: dict[str, str], **sections: Any) -> Path:
    config: dict[str, Any] = {
        "name": "tiny",
        "seed": 3,
        "steps": 2,
        "model": {"path": assets["model"]},
        "data": {"path": assets["data"]},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 6},
        "reward": {"name": "miles_test_rewards:vowel_fraction"},
        "train": {"lr": 1.0e-3, "micro_batch_tokens": 128},
        "telemetry": {"progress": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


# ── installing distributions for real: wheels into throwaway virtual environments ───────────────
# Each venv gets only the wheels under test, installed by pip, so entry points and console scripts
# are real. Third-party dependencies (pluggy, click, ...) are linked in from this environment, so
# no network is needed; every miles-* distribution is left out of that link-in.

ROOT = Path(__file__).resolve().parents[1]


def sh(*args: str | Path, **kw: Any) -> str:
    """Runs a command; fails the test with its output unless it exits 0. Returns stdout."""
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return str(out.stdout)


def build_wheel(source: Path, out: Path) -> Path:
    """Builds one project's wheel into `out` (no build isolation: hatchling comes from here)."""
    before = set(out.glob("*.whl"))
    sh(*_PIP_WHEEL, "-w", out, source)
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


_PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")


def _is_miles(entry: Path) -> bool:
    """A miles-* distribution's entry in site-packages: its package, its dist-info, or a path
    hook of an editable install (`_editable_impl_miles_core.pth`, `__editable__.miles_core-*`).
    Any `.pth` that names a path inside this repository counts too, whatever its name: linked
    into a venv, it would put a workspace `src` tree on the path."""
    lowered = entry.name.lower().replace("-", "_")
    if lowered.startswith(("miles", "__editable__.miles", "_miles", "_editable_impl_miles")):
        return True
    return entry.suffix == ".pth" and str(ROOT) in entry.read_text(errors="replace")


def make_venv(path: Path, *wheels: Path, only_declared: bool = False) -> Path:
    """A virtual environment holding exactly these wheels, plus this environment's third parties:
    all of them, or (`only_declared`) only what the wheels declare they need, transitively."""
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False).create(path)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    here = Path(sysconfig.get_paths()["purelib"])
    if only_declared:
        entries = {here / name for name in _top_level_entries(_dependency_closure(wheels))}
    else:
        entries = {e for e in here.iterdir() if not _is_miles(e) and e.name != "__pycache__"}
    for entry in sorted(entries):
        (site / entry.name).symlink_to(entry)
    pip = (sys.executable, "-m", "pip", "--python", path / "bin/python", "install", "-q")
    sh(*pip, "--no-deps", "--no-index", *wheels)
    return path


def _dependency_closure(wheels: tuple[Path, ...]) -> set[str]:
    """The installed distributions these wheels require, with what those require, and so on
    (markers evaluated; extras not requested are left out)."""
    import importlib.metadata as md
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def requirements(lines: list[str]) -> list[Requirement]:
        reqs = [Requirement(line) for line in lines]
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]

    todo: list[Requirement] = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            text = zf.read(meta).decode()
        todo += requirements(
            [ln[14:] for ln in text.splitlines() if ln.startswith("Requires-Dist: ")]
        )
    seen: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop().name)
        if name in seen or name.startswith("miles"):
            continue
        seen.add(name)
        todo += requirements(md.distribution(name).requires or [])
    return seen


def _top_level_entries(dists: set[str]) -> set[str]:
    """The site-packages entries (packages, modules, dist-info) of these distributions."""
    import importlib.metadata as md

    entries: set[str] = set()
    for name in dists:
        for file in md.distribution(name).files or []:
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                entries.add(top)
    return entries


def venv_env() -> dict[str, str]:
    """This process's environment without MILES_* and PYTHON* variables, for a venv's commands."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MILES_", "PYTHON"))}


@pytest.fixture(scope="session")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """miles-core, built once per session."""
    return build_wheel(ROOT / "packages/miles-core", tmp_path_factory.mktemp("core-wheel"))


@pytest.fixture(scope="session")
def runtime_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """miles-runtime, built once per session."""
    return build_wheel(ROOT / "packages/miles-runtime", tmp_path_factory.mktemp("runtime-wheel"))


# ── a traced run, shared by the tracing and report tests ────────────────────────────────────────

TRACED_RANKS = ("miles.train0", "miles.train1")
TRACED_ENGINES = ("miles.engine0", "miles.engine1")
TRACED_STEPS = 2


class _Receiver(BaseHTTPRequestHandler):
    bodies: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.bodies.append((self.path, self.headers.get("Content-Type", ""), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def traced_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, str]
) -> tuple[Path, list[tuple[str, str, bytes]]]:
    """The observed run: 2 steps, 2 train ranks, 2 engines, a checkpoint every step; its spans
    also go over OTLP/HTTP to a loopback receiver, and its metrics to every metric sink (W&B
    offline), plus a second MLflow sink whose store is unusable, so it fails at its first log
    (a real MLflow error) and is switched off. Returns (run dir, the OTLP requests received).
    Shared by the tracing, report and sink tests: one run, observed every way."""
    root = tmp_path_factory.mktemp("traced")
    blocker = root / "blocker"
    blocker.write_text("a regular file where the MLflow store's folder should be")
    sinks = [
        "jsonl",
        "tensorboard",
        {"name": "wandb", "mode": "offline", "tags": ["e2e"]},
        "mlflow",
        {"name": "mlflow", "tracking_uri": f"sqlite:///{blocker}/mlflow.db"},
    ]
    cfg = write_config(
        root / "cfg.yaml",
        tiny_assets,
        steps=TRACED_STEPS,
        rollout={"engines": len(TRACED_ENGINES)},
        train={"world_size": len(TRACED_RANKS)},
        checkpoint={"every": 1},
        telemetry={"progress": False, "sinks": sinks, "profile_steps": [TRACED_STEPS]},
    )
    _Receiver.bodies = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
        }
        proc = run_miles("run", str(cfg), "--run-dir", str(root / "run"), env=env)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "run", list(_Receiver.bodies)
