"""Several Ray nodes on this machine, as a real multi-node cluster is started: a head with no
CPUs or GPUs for actors (`ray start --head --num-cpus=0`) and worker raylets with their own
resources and topology labels (`ray start --address=... --labels rack=r1`). `miles run
--ray-address` drives it from outside; actors land on the workers where the layout says, and a
worker whose raylet is killed mid-run costs its actors a restart elsewhere, not the run."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import MILES, TEST_MODULES, read_jsonl

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(1200)


class LocalCluster:
    """`ray start` processes, each in a session of its own: stopping one stops that node only.
    Each node's output goes to LOGS/NAME.log, shown when a test fails."""

    def __init__(self, logs: Path) -> None:
        # Ray's own CLI, from this interpreter's Ray (no `ray` script needed on the PATH).
        self.ray = [sys.executable, "-m", "ray.scripts.scripts"]
        # A cluster with its own token, as a shared cluster would have.
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            # Workers import the run's code, as on a cluster (and whatever the path had).
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(TEST_MODULES), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.address = ""

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            node = subprocess.Popen(
                # No log monitor: `miles run` reads no actor output through Ray.
                [
                    *self.ray,
                    "start",
                    "--block",
                    "--disable-usage-stats",
                    "--include-log-monitor=false",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.nodes.append(node)
        return node

    def output(self) -> str:
        return "".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in self.logs.glob("*.log"))

    def start_head(self) -> None:
        head = self._start(
            "head",
            "--head",
            "--port=0",
            "--num-cpus=0",
            "--num-gpus=0",
            "--include-dashboard=false",
        )
        deadline = time.monotonic() + 120
        while not self.address:
            for line in (self.logs / "head.log").read_text().splitlines():
                if "ray start --address=" in line:
                    self.address = line.split("'")[1]
            assert head.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def add_worker(self, cpus: int, rack: str, name: str, gpus: int = 0) -> subprocess.Popen[bytes]:
        """A worker node, started once the last one is up: Ray gives a raylet 30 s to register,
        which several starting at once on a loaded machine can miss (then it is started
        again)."""
        args = (
            f"--address={self.address}",
            f"--num-cpus={cpus}",
            f"--num-gpus={gpus}",  # CPU nodes unless asked, even on a machine with a GPU
            f"--labels=rack={rack},name={name}",
        )
        for _ in range(3):
            node = self._start(name, *args)
            deadline = time.monotonic() + 180
            while node.poll() is None and time.monotonic() < deadline:
                if "Ray runtime started" in (self.logs / f"{name}.log").read_text():
                    return node
                time.sleep(0.2)
            self.kill(node)
        raise AssertionError(f"worker {name} did not start:\n{self.output()}")

    def wait_for_cpus(self, cpus: int, node: str = "") -> None:
        """Until the cluster offers `cpus` CPUs (and the node named `node` is up); then
        `node_table` lists the nodes."""
        probe = (
            "import ray, time\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "deadline = time.time() + 120\n"
            "def up():\n"
            f"    names = [n.get('Labels', {{}}).get('name') for n in ray.nodes() if n['Alive']]\n"
            f"    return not {node!r} or {node!r} in names\n"
            f"while (ray.cluster_resources().get('CPU', 0) < {cpus} or not up()) "
            "and time.time() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print('CPUS', int(ray.cluster_resources().get('CPU', 0)))\n"
            "print('NODES', __import__('json').dumps([{'id': n['NodeID'], 'alive': n['Alive'], "
            "'labels': n.get('Labels', {}), 'cpus': n['Resources'].get('CPU', 0)} "
            "for n in ray.nodes()]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=self.env, timeout=180
        )
        # Ray's own messages (a node marked dead, ...) can come in between: read ours by name.
        said = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
        assert done.returncode == 0 and int(said.get("CPUS", -1)) >= cpus, (
            done.stdout + done.stderr + self.output()
        )
        self.node_table: list[dict[str, Any]] = json.loads(said["NODES"])

    def kill(self, node: subprocess.Popen[bytes]) -> None:
        """The node dies: its raylet and every worker process on it, at once."""
        with contextlib.suppress(ProcessLookupError):  # nothing of it is left
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    def stop(self) -> None:
        """Every node at once (a graceful `ray stop` drains each for up to 30 s)."""
        for node in self.nodes:  # a node's `ray start` may have exited and left processes
            self.kill(node)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "nodes")
    try:
        c.start_head()
        yield c
    finally:
        c.stop()


def _miles_run(cluster: LocalCluster, run: Path, *sets: str) -> subprocess.Popen[str]:
    args = [*MILES, "run", "quickstart", "--run-dir", str(run), "--ray-address", cluster.address]
    for s in ("train.world_size=2", "rollout.engines=2", "cluster.topology_label=rack",
              "telemetry.progress=false", *sets):  # fmt: skip
        args += ["--set", s]
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env
    )


def _wait_for_a_step(proc: subprocess.Popen[str], run: Path, cluster: LocalCluster) -> None:
    """Until the run's first step is in metrics.jsonl; fails with its output if it ends first."""
    deadline = time.monotonic() + 600
    while not (run / "metrics.jsonl").is_file() or not read_jsonl(run / "metrics.jsonl"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"no step (exit {proc.returncode}):\n{out[-4000:]}\n{cluster.output()}")
        time.sleep(0.05)


def test_a_cpu_head_and_worker_nodes_run_the_quickstart_where_the_layout_says(tmp_path, cluster):
    cluster.add_worker(2, "r1", "w0")
    cluster.add_worker(2, "r1", "w1")
    cluster.wait_for_cpus(4)
    run = tmp_path / "run"
    # Where the actors go and that weights cross nodes exactly: a short run says it (learning
    # itself is the quickstart's own test).
    proc = _miles_run(cluster, run, "steps=6", "warmstart.steps=5", "eval.data=null")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]

    layout = json.loads((run / "manifest.json").read_text())["layout"]
    nodes = {n["id"]: n for n in cluster.node_table}
    head = next(n["id"] for n in cluster.node_table if n["cpus"] == 0)
    train = [x for x in layout if x["role"] == "train"]
    engines = [x for x in layout if x["role"] == "engine"]
    assert [x["rank"] for x in train] == [0, 1] and [x["rank"] for x in engines] == [0, 1]
    assert all(x["node_id"] in nodes and x["node_id"] != head for x in layout)  # workers only
    # The engine group and rollout manager sit beside the driver, on the head.
    assert json.loads((run / "manifest.json").read_text())["coordinator_node_id"] == head
    assert all(x["topology"] == nodes[x["node_id"]]["labels"]["rack"] for x in layout)
    # Train ranks fill a node before the next; the engines then take the other node, so every
    # batch and every weight sync crosses nodes.
    assert train[0]["node_id"] == train[1]["node_id"]
    assert {x["node_id"] for x in engines} == {
        n for n in nodes if n not in (head, train[0]["node_id"])
    }
    assert '"event": "placement"' in (run / "events.jsonl").read_text()

    # Every step's samples were generated with the weights the trainers had just sent across
    # nodes (the engines' logprobs are the trainers' own), and those weights changed each step.
    steps = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(steps) == 6 and all(m["train/rollout_logprob_abs_diff"] < 1e-4 for m in steps)
    assert all(m["train/grad_norm"] > 0 for m in steps), steps


def _faults(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("fault") == kind]


def test_a_worker_node_lost_mid_run_costs_restarts_not_the_run(tmp_path, cluster):
    """The engines' node dies (its raylet killed): their restarts wait for a place until a spare
    node joins, Ray re-places their bundles there, the engines restart on it and rejoin the
    weight sync, and every sample is recorded once."""
    workers = {"w0": cluster.add_worker(2, "r1", "w0"), "w1": cluster.add_worker(2, "r1", "w1")}
    cluster.wait_for_cpus(4)
    run = tmp_path / "run"
    steps = 8
    proc = _miles_run(
        cluster, run, f"steps={steps}", "warmstart.steps=5", "eval.data=null",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "fault.backoff_s=0.5",
    )  # fmt: skip
    try:
        _wait_for_a_step(proc, run, cluster)
        deadline = time.monotonic() + 600
        # The driver holds still from here until both engines are back (failure detection,
        # re-placement and restarts all run in the engine group's actor), so the run cannot
        # end first; then it goes on, and its next weight sync takes the new engines in.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            layout = json.loads((run / "manifest.json").read_text())["layout"]
            engine_node = next(x["node_id"] for x in layout if x["role"] == "engine")
            nodes = cluster.node_table
            name = next(n["labels"]["name"] for n in nodes if n["id"] == engine_node)
            cluster.kill(workers[name])
            # No node has room for the lost engines: their restarts wait for a place...
            while len(_faults(run, "engine_failed")) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.5)
            time.sleep(3)
            assert not _faults(run, "engine_restarted")
            # ...which a node joining now gives them.
            spare = cluster.add_worker(2, "r2", "spare")
            cluster.wait_for_cpus(4, node="spare")
            while len(_faults(run, "engine_restarted")) < 2:
                assert time.monotonic() < deadline, _faults(run, "engine_failed")
                time.sleep(0.5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
        assert spare.poll() is None
        assert "engine restarts" in out.split("faults survived:")[-1], out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {e["engine"] for e in _faults(run, "engine_failed")} == {0, 1}
    restarted = _faults(run, "engine_restarted")
    assert {e["engine"] for e in restarted} == {0, 1}
    spare_id = next(n["id"] for n in cluster.node_table if n["labels"].get("name") == "spare")
    assert {e["node_id"] for e in restarted} == {spare_id}  # re-placed on the node left
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(rows) == steps
    # The restarted engines generate with exactly the trainer's weights. (A step that trains
    # nothing has no train metrics.)
    diffs = [m["train/rollout_logprob_abs_diff"] for m in rows if "train/loss" in m]
    assert "train/loss" in rows[-1] and max(diffs) < 1e-4
    # Every sample recorded once, none lost. Samples the lost engines' replacements made before
    # they had the current weights are recorded stale and not trained (at most one step's).
    ledger = read_jsonl(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    fates = [r["fate"] for r in ledger]
    assert set(fates) <= {"trained", "stale"} and fates.count("stale") <= 8 * 4
    assert fates.count("trained") >= (steps - 1) * 8 * 4


def test_cluster_device_cuda_on_a_cluster_without_gpus_is_a_clear_error(tmp_path: Path) -> None:
    """`cluster.device=cuda` asks the cluster, not the driver: Ray here has no GPUs, so the run
    stops before any actor starts, saying what to do."""
    done = subprocess.run(
        [*MILES, "run", "quickstart", "--run-dir", str(tmp_path / "run"),
         "--set", "cluster.device=cuda", "--set", "telemetry.progress=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cluster.device=cuda, but the Ray cluster has no GPUs" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
def test_a_driver_without_cuda_runs_a_gpu_worker_nodes_gpus(tmp_path, cluster):
    """The driver cannot see a GPU (CUDA_VISIBLE_DEVICES empty) and the head offers none; the
    worker node's GPU is found through the cluster, and the run trains on it."""
    cluster.add_worker(4, "r1", "gpu0", gpus=1)
    cluster.wait_for_cpus(4)
    cluster.env["CUDA_VISIBLE_DEVICES"] = ""  # the driver's view only: the worker already started
    run = tmp_path / "run"
    proc = _miles_run(
        cluster, run, "train.world_size=1", "rollout.engines=1", "placement=colocated",
        "cluster.device=cuda", "steps=4",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    layout = json.loads((run / "manifest.json").read_text())["layout"]
    assert [(x["role"], len(x["gpus"])) for x in layout] == [("train", 1), ("engine", 1)]
    head = next(n["id"] for n in cluster.node_table if n["cpus"] == 0)
    assert all(x["node_id"] != head for x in layout)
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(rows) == 4 and all(m["train/rollout_logprob_abs_diff"] < 1e-2 for m in rows)


def test_the_train_ranks_node_lost_mid_run_restarts_the_train_group_on_a_new_node(
    tmp_path, cluster
):
    """The node of both train ranks dies: the driver finds the train group gone at its next
    call, waits for a place (a spare node joins 3 s later), starts the group there from the
    newest snapshot (in /dev/shm, which every node on this machine sees), redoes the steps
    since, and finishes; every sample is recorded once."""
    workers = {"w0": cluster.add_worker(2, "r1", "w0"), "w1": cluster.add_worker(2, "r1", "w1")}
    cluster.wait_for_cpus(4)
    run = tmp_path / "run"
    # The run is still going when its first row is seen (it is stopped then): its steps take
    # about 0.3 s here, and a loaded machine can take seconds to see the row.
    steps = 24
    proc = _miles_run(
        cluster, run, f"steps={steps}", "warmstart.steps=5", "eval.data=null",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "fault.backoff_s=0.5",
    )  # fmt: skip
    try:
        _wait_for_a_step(proc, run, cluster)
        os.kill(proc.pid, signal.SIGSTOP)  # the node dies before the run can end
        try:
            layout = json.loads((run / "manifest.json").read_text())["layout"]
            train_node = next(x["node_id"] for x in layout if x["role"] == "train")
            nodes = cluster.node_table
            name = next(n["labels"]["name"] for n in nodes if n["id"] == train_node)
            cluster.kill(workers[name])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(3)
        spare = cluster.add_worker(2, "r2", "spare")
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
        assert spare.poll() is None
        assert "train restart" in out.split("faults survived:")[-1], out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(_faults(run, "train_restarted")) == 1
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(rows) == steps and "train/loss" in rows[-1]
    assert rows[-1]["train/rollout_logprob_abs_diff"] < 1e-4  # the new group's weights synced
    ledger = read_jsonl(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    assert {r["fate"] for r in ledger} <= {"trained", "stale"}


def test_a_lost_node_that_no_node_replaces_fails_the_run_clearly(tmp_path, cluster):
    """Nothing has room for the lost engines within fault.node_wait_s: each restart gives up,
    and with no engine left the run stops, naming what it waited for."""
    workers = [cluster.add_worker(2, "r1", "w0"), cluster.add_worker(2, "r1", "w1")]
    cluster.wait_for_cpus(4)
    run = tmp_path / "run"
    proc = _miles_run(
        cluster, run, "steps=200", "warmstart.steps=1", "eval.data=null",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "fault.backoff_s=0.2",
        "fault.node_wait_s=3", "fault.max_engine_restarts=1",
    )  # fmt: skip
    try:
        _wait_for_a_step(proc, run, cluster)
        layout = json.loads((run / "manifest.json").read_text())["layout"]
        engine_node = next(x["node_id"] for x in layout if x["role"] == "engine")
        name = next(n["labels"]["name"] for n in cluster.node_table if n["id"] == engine_node)
        cluster.kill(workers[0] if name == "w0" else workers[1])
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "found no place on the nodes left within fault.node_wait_s=3s" in out, out[-3000:]
    # What a person reads (the log's JSON lines aside) holds no traceback.
    said = "\n".join(line for line in out.splitlines() if not line.startswith("{"))
    assert "no rollout engine is left" in said and "Traceback" not in said, said[-3000:]
