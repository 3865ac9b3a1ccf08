"""Rollout backend `sglang` against `miles serve` processes: the quickstart end to end over
SGLang's HTTP protocol (generation, the weight-update group, verification by checksum)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(1200)


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


def test_without_sglang_or_urls_the_run_stops_before_launch_and_says_what_to_do(tmp_path):
    done = miles_run(
        "quickstart", "--run-dir", str(tmp_path / "run"), "--set", "rollout.backend=sglang"
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "pip install 'miles-sglang[server]'" in out, out[-2000:]
    assert "rollout.server=miles" in out and "rollout.urls=" in out, out[-2000:]
    assert "Traceback" not in out
    assert not (tmp_path / "run").exists()  # a refused run leaves nothing behind


def test_an_older_sglang_is_refused_with_the_version_needed(monkeypatch):
    from miles.core.contracts.backends import RolloutSetup
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


def test_a_server_that_dies_mid_answer_is_unavailable_not_a_crash():
    """A server killed while it sends an answer (fewer bytes than its Content-Length, or none
    at all) is an engine failure the run survives, as a refused connection is."""
    import socket
    import threading

    from miles.sglang.engine import ServerUnavailable, SGLangClient

    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 325\r\n\r\n{",
        b"",  # closed before the status line
    ]
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            request = b""
            while b"\r\n\r\n" not in request:  # the whole request is read: no reset
                request += conn.recv(65536)
            head, body = request.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(answer)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{listener.getsockname()[1]}", None, timeout_s=10)
    with pytest.raises(ServerUnavailable, match="IncompleteRead"):
        client.call("/generate", {"input_ids": [1]})
    with pytest.raises(ServerUnavailable, match="RemoteDisconnected"):
        client.call("/generate", {"input_ids": [1]})
    listener.close()


def test_an_attached_server_that_dies_is_quarantined_and_rejoins_when_it_is_back(
    quickstart_model, tmp_path, serve_process
):
    """Killed mid-run: its requests move to the other server and Miles retries its URL with
    back-off (quarantine); once a server answers there again, the engine rejoins the
    weight-update group at the next sync. No sample is lost or trained twice."""
    import time

    start_server, stop_server = serve_process
    servers = [start_server(quickstart_model, tmp_path) for _ in range(2)]
    run = tmp_path / "run"
    steps, prompts, samples = 8, 4, 4
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
             "--set", "fault.backoff_s=0.25", "--set", "fault.backoff_max_s=1",
             "--set", "fault.max_engine_restarts=60",
             "--set", "eval.data=null", "--set", "telemetry.progress=false"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").is_file() or not rows(run / "metrics.jsonl"):
            assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        servers[1].process.kill()  # mid-run: after the first step, before the last
        while '"engine_failed"' not in (run / "events.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no failure seen"
            time.sleep(0.2)
        # Seen: the driver holds still until the server is back and the engine group (its own
        # actor, retrying meanwhile) has restarted the engine on it; a loaded machine can take
        # longer for both than the run needs to end.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            port = int(servers[1].url.rsplit(":", 1)[1])
            servers[1] = start_server(quickstart_model, tmp_path, port=port)  # back, same URL
            while '"engine_restarted"' not in (run / "events.jsonl").read_text():
                assert time.monotonic() < deadline, "the engine was not restarted"
                time.sleep(0.5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
        # The server that came back took part: it holds the run's last weights.
        assert servers[1].call("/get_weight_version")[1] == {"weight_version": str(steps + 1)}
    finally:
        for server in servers:
            stop_server(server)
    metrics = rows(run / "metrics.jsonl")
    assert len([m for m in metrics if "rollout/reward_mean" in m]) == steps
    events = rows(run / "events.jsonl")
    failed = [e for e in events if e.get("fault") == "engine_failed"]
    assert failed and all(e["engine"] == 1 for e in failed), failed
    assert [e["engine"] for e in events if e.get("fault") == "engine_restarted"] == [1]
    assert not [e for e in events if e.get("fault") == "engine_dropped"]
    # As the fault tests count them: every sample recorded once, none lost, all trained.
    ledger = rows(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    assert len([r for r in ledger if r["fate"] == "trained"]) == steps * prompts * samples


def test_async_partial_rollouts_through_the_server(quickstart_model, tmp_path, serve_process):
    """mode async over HTTP: a weight update pauses the server (mode abort) while the next
    batch generates; the cut requests finish with the new weights (tokens of two versions in
    one sample), staleness stays within its bound, and every sample is trained once."""
    start_server, stop_server = serve_process
    # The paged path batches continuously (requests join running ones), as SGLang does: a pause
    # finds the batch mid-generation rather than queued behind a running one.
    # An update cuts a batch when it comes one train step after the batch starts: with
    # max_staleness 1 that is every other step (batches 2 and 4 of 6). Timing alone did not make
    # the cut certain (CI on 6e65f1c: no sample spanned an update): the random model ends most
    # answers after about 10 tokens, and the cut requests had no token yet. So the test server
    # (miles.serve.testing.slow_engine) decodes one token per 100 ms step and runs every answer to max_new_tokens
    # (full_length, as SGLang's ignore_eos): a batch generates for 3.2 s at least, longer than a
    # train step and a sync, and a request has its first token one step after it arrives.
    server = start_server(
        quickstart_model, tmp_path, "--engine-path", "paged", slow=0.1, full_length=True
    )
    run = tmp_path / "run"
    steps, prompts, samples = 6, 8, 4
    try:
        done = miles_run(
            "quickstart", "--run-dir", str(run),
            "--set", f"model.path={quickstart_model}",
            "--set", "rollout.backend=sglang", "--set", f"rollout.urls=[{server.url}]",
            "--set", "mode=async", "--set", "async.max_staleness=1",
            "--set", "async.on_weight_update=continue", "--set", "algorithm.correction=tis",
            "--set", "warmstart.steps=0", "--set", "rollout.max_new_tokens=32",
            "--set", "train.micro_batch_tokens=64",
            "--set", f"steps={steps}", "--set", f"rollout.prompts_per_step={prompts}",
            "--set", f"rollout.samples_per_prompt={samples}",
            "--set", "eval.data=null", "--set", "telemetry.progress=false",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        stop_server(server)
    metrics = [m for m in rows(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(metrics) == steps
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    assert sum(m["async/requeued"] for m in metrics) > 0  # updates did cut requests short
    ledger = rows(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    trained = [r for r in ledger if r["fate"] == "trained"]
    assert len(trained) == steps * prompts * samples
    mixed = [r for r in ledger if r["weight_versions"][0] != r["weight_versions"][1]]
    print(f"{len(mixed)} of {len(ledger)} samples span a weight update")
    assert mixed, "no sample spans a weight update"


def test_colocated_engines_take_the_weights_by_reference(tmp_path):
    """placement: colocated: each engine's launched server shares its train rank's device and
    takes every bucket through /update_weights_from_tensor (CUDA IPC on a GPU, a shared-memory
    file on the CPU); the engine samples with exactly the trainer's weights."""
    run = tmp_path / "run"
    done = miles_run(
        "quickstart", "--run-dir", str(run),
        "--set", "rollout.backend=sglang", "--set", "rollout.server=miles",
        "--set", "placement=colocated", "--set", "steps=4", "--set", "warmstart.steps=5",
        "--set", "eval.data=null", "--set", "telemetry.progress=false",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [m for m in rows(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert [m["weights/version"] for m in steps] == [2.0, 3.0, 4.0, 5.0]
    for m in steps:  # verified by checksum after every sync, and the same logprobs
        assert "perf/sync_verify_s" in m and m["train/rollout_logprob_abs_diff"] < 1e-4, m


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


def test_a_launched_servers_command_line():
    from miles.core.contracts.backends import RolloutSetup
    from miles.precision.dtype import bf16
    from miles.sglang.config import SGLangConfig
    from miles.sglang.launcher import server_command

    setup = RolloutSetup(
        model_path="/m", device="cuda", seed=7, precision=bf16(), record_routing="ids", index=1
    )
    args = {"mem_fraction_static": 0.8, "enable_memory_saver": True, "disable_radix_cache": False}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "2,3")
        command = server_command(SGLangConfig(server_args=args), setup, 31000)
    line = " ".join(command)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    for part in ("--model-path /m", "--port 31000", "--host 127.0.0.1", "--tp-size 2",
                 "--random-seed 7", "--dtype bfloat16", "--enable-return-routed-experts",
                 "--mem-fraction-static 0.8", "--enable-memory-saver"):  # fmt: skip
        assert part in line, line
    assert "radix" not in line  # false: the flag is left out
    miles = " ".join(server_command(SGLangConfig(server="miles"), setup, 31000))
    assert "-m miles.core.cli serve /m" in miles and "--record-routing" in miles
    with pytest.raises(ValueError, match="server_args are flags for servers Miles launches"):
        SGLangConfig(urls=["http://127.0.0.1:1"], server_args=args)


def test_launched_servers_train_and_a_dead_one_is_relaunched(tmp_path):
    """Each engine launches its own `miles serve` (rollout.server: miles); killing one mid-run
    gets it relaunched by its engine's restart, re-joined to the weight-update group at the
    next sync; no sample is lost, and no server outlives the run."""
    import os
    import signal
    import time

    run = tmp_path / "run"
    steps, prompts, samples = 8, 4, 4
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.core.cli", "run", "quickstart", "--run-dir", str(run),
         "--set", "rollout.backend=sglang", "--set", "rollout.server=miles",
         "--set", "rollout.engines=2",
         "--set", f"steps={steps}", "--set", "warmstart.steps=5",
         "--set", f"rollout.prompts_per_step={prompts}",
         "--set", f"rollout.samples_per_prompt={samples}",
         "--set", "fault.backoff_s=0.1", "--set", "fault.backoff_max_s=1",
         "--set", "fault.max_engine_restarts=30", "--set", "fault.health_check_s=5",
         "--set", "eval.data=null",
         "--set", "telemetry.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").is_file() or not rows(run / "metrics.jsonl"):
            assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        launched = [e for e in rows(run / "events.jsonl") if e["event"] == "server launched"]
        assert sorted(e["engine"] for e in launched) == [0, 1]
        supervisor = next(e["supervisor_pid"] for e in launched if e["engine"] == 1)
        children = subprocess.run(
            ["pgrep", "-P", str(supervisor)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 1, children
        # The driver holds still while the server dies and is relaunched (the engine group's
        # health checks and restarts run in their own actors): however slow the relaunch, the
        # run cannot end before it, and it goes on with the engine back.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(int(children[0]), signal.SIGKILL)  # the server itself dies, mid-run
            while not any(e.get("fault") == "engine_restarted" for e in rows(run / "events.jsonl")):
                assert time.monotonic() < deadline, "the engine was not restarted"
                time.sleep(0.5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    events = rows(run / "events.jsonl")
    assert [e["engine"] for e in events if e.get("fault") == "engine_failed"] == [1]
    assert [e["engine"] for e in events if e.get("fault") == "engine_restarted"] == [1]
    relaunched = [e for e in events if e["event"] == "server launched" and e["engine"] == 1]
    assert len(relaunched) == 2 and relaunched[0]["url"] != relaunched[1]["url"]
    steps_rows = [m for m in rows(run / "metrics.jsonl") if "rollout/reward_mean" in m]
    assert len(steps_rows) == steps
    for m in steps_rows:  # the relaunched server got the current weights before it served
        assert m["train/rollout_logprob_abs_diff"] < 1e-4, m
    ledger = rows(run / "samples.jsonl")
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    assert len([r for r in ledger if r["fate"] == "trained"]) == steps * prompts * samples
    logs = sorted(p.name for p in (run / "servers").iterdir())
    assert len(logs) == 3 and all(p.startswith("engine") for p in logs), logs
    time.sleep(2)  # the supervisors stop their servers within half a second of the actors
    left = subprocess.run(["pgrep", "-f", f"serve {run}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
