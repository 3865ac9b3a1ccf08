"""Rollout backend `sglang` against `miles serve` processes: the quickstart end to end over
SGLang's HTTP protocol (generation, the weight-update group, verification by checksum)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def miles_run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles.core.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The quickstart recipe's own tiny model (its tokenizer, seed 0), made before the run so a
    server can load it first."""
    from miles.recipes import quickstart_task

    model = tmp_path_factory.mktemp("quickstart") / "model"
    quickstart_task.build_model(model, 0)
    return str(model)


def test_the_quickstart_learns_through_miles_serve(quickstart_model, tmp_path, serve_process):
    start_server, stop_server = serve_process
    server = start_server(quickstart_model, tmp_path)
    try:
        run = tmp_path / "run"
        done = miles_run(
            "quickstart", "--run-dir", str(run),
            "--set", f"model.path={quickstart_model}",
            "--set", "rollout.backend=sglang",
            "--set", f"rollout.urls=[{server.url}]",
            "--set", "telemetry.progress=false",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        metrics = rows(run / "metrics.jsonl")
        steps = [m for m in metrics if "rollout/reward_mean" in m]
        evals = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
        assert len(steps) == 30
        # The engine behind HTTP samples with the trainer's weights: the same logprobs (fp32).
        for m in steps:
            assert m["train/rollout_logprob_abs_diff"] < 1e-4, m
        # Every sync went through the weight-update group and was verified by checksum.
        assert [m["weights/version"] for m in steps] == [float(v) for v in range(2, 32)]
        assert all("perf/sync_verify_s" in m for m in steps)
        # It learns: the rule (answer the largest number) is found, as with the embedded engine.
        assert steps[0]["rollout/reward_mean"] < 0.3
        assert evals[-1] >= 0.6, evals
        info = server.call("/get_weight_version")[1]
        assert info == {"weight_version": "31"}
    finally:
        stop_server(server)


def test_without_servers_the_run_stops_before_launch_and_says_how_to_attach(tmp_path):
    done = miles_run(
        "quickstart", "--run-dir", str(tmp_path / "run"), "--set", "rollout.backend=sglang"
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "set rollout.urls" in out and "miles serve" in out, out[-2000:]
    assert "Traceback" not in out
    assert not (tmp_path / "run").exists()  # a refused run leaves nothing behind


def test_an_older_sglang_is_refused_with_the_version_needed(monkeypatch):
    from miles.core.backends import RolloutSetup
    from miles.precision.dtype import fp32
    from miles.sglang.config import SGLangConfig
    from miles.sglang.engine import ServerError, SGLangClient, SGLangEngine

    answers = {"/get_server_info": {"version": "0.4.10"}, "/get_weight_version": {}}
    monkeypatch.setattr(SGLangClient, "call", lambda self, path, body=None, **_: answers[path])
    setup = RolloutSetup(model_path="m", device="cpu", seed=0, precision=fp32())
    with pytest.raises(ServerError, match=r"runs SGLang 0\.4\.10; .* needs SGLang >= 0\.5"):
        SGLangEngine(SGLangConfig(urls=["http://127.0.0.1:1"]), setup)
    answers["/get_server_info"] = {"version": "0.5.3"}
    engine = SGLangEngine(SGLangConfig(urls=["http://127.0.0.1:1"]), setup)
    assert engine.weight_version == 0
    with pytest.raises(ValueError, match="rollout engine 1 has no server"):
        SGLangEngine(
            SGLangConfig(urls=["http://127.0.0.1:1"]),
            RolloutSetup(model_path="m", device="cpu", seed=0, precision=fp32(), index=1),
        )


def test_a_server_killed_mid_run_is_dropped_and_no_sample_is_lost(
    quickstart_model, tmp_path, serve_process
):
    import time

    start_server, stop_server = serve_process
    servers = [start_server(quickstart_model, tmp_path) for _ in range(2)]
    run = tmp_path / "run"
    steps, prompts, samples = 6, 8, 4
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles.core.cli", "run", "quickstart", "--run-dir", str(run),
             "--set", f"model.path={quickstart_model}",
             "--set", "rollout.backend=sglang",
             "--set", f"rollout.urls=[{servers[0].url}, {servers[1].url}]",
             "--set", "rollout.engines=2",
             "--set", f"steps={steps}", "--set", "warmstart.steps=5",
             "--set", f"rollout.prompts_per_step={prompts}",
             "--set", f"rollout.samples_per_prompt={samples}",
             "--set", "fault.backoff_s=0.1", "--set", "fault.max_engine_restarts=1",
             "--set", "eval.data=null", "--set", "telemetry.progress=false"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").is_file() or not rows(run / "metrics.jsonl"):
            assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        servers[1].process.kill()  # mid-run: after the first step, before the last
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
    finally:
        for server in servers:
            stop_server(server)
    metrics = rows(run / "metrics.jsonl")
    assert len([m for m in metrics if "rollout/reward_mean" in m]) == steps
    failed = [e for e in rows(run / "events.jsonl") if e.get("fault") == "engine_failed"]
    assert failed and all(e["engine"] == 1 for e in failed), failed
    # As the fault tests count them: every sample recorded once, none lost, all trained.
    ledger = rows(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    assert len([r for r in ledger if r["fate"] == "trained"]) == steps * prompts * samples


def test_routing_replay_from_the_servers_routed_experts(tmp_path, serve_process):
    from miles.recipes import quickstart_task

    model = tmp_path / "moe"
    quickstart_task.build_model(model, 0, family="qwen3_moe")
    start_server, stop_server = serve_process
    server = start_server(str(model), tmp_path, "--record-routing")
    try:
        run = tmp_path / "run"
        done = miles_run(
            "quickstart-moe", "--run-dir", str(run),
            "--set", f"model.path={model}",
            "--set", "rollout.backend=sglang",
            "--set", f"rollout.urls=[{server.url}]",
            "--set", "steps=3", "--set", "warmstart.steps=5",
            "--set", "rollout.prompts_per_step=8", "--set", "eval.data=null",
            "--set", "telemetry.progress=false",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        stop_server(server)
    steps = [m for m in rows(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(steps) == 3
    for m in steps:  # the trainer routed every token through the experts the server chose
        assert m["moe/replayed_match"] == 1.0, m
        assert m["train/rollout_logprob_abs_diff"] < 1e-4, m


def test_routing_replay_needs_a_server_that_returns_routes(tmp_path, serve_process):
    from miles.recipes import quickstart_task

    model = tmp_path / "moe"
    quickstart_task.build_model(model, 0, family="qwen3_moe")
    start_server, stop_server = serve_process
    server = start_server(str(model), tmp_path)  # no --record-routing
    try:
        done = miles_run(
            "quickstart-moe", "--run-dir", str(tmp_path / "run"),
            "--set", f"model.path={model}", "--set", "rollout.backend=sglang",
            "--set", f"rollout.urls=[{server.url}]", "--set", "steps=1",
            "--set", "warmstart.steps=0", "--set", "telemetry.progress=false",
        )  # fmt: skip
    finally:
        stop_server(server)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "miles serve --record-routing" in out and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "run").exists()  # stopped before launch


def test_a_server_that_does_not_answer_stops_the_run_before_launch(tmp_path):
    done = miles_run(
        "quickstart", "--run-dir", str(tmp_path / "run"), "--set", "rollout.backend=sglang",
        "--set", "rollout.urls=[http://127.0.0.1:9]",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in out
    assert "rollout server http://127.0.0.1:9 does not answer" in out, out[-2000:]
