"""Modes, placements and faults end to end, on CPU: one_step_off and async runs, colocated
engines, chaos (a killed engine, a hung engine, a killed train rank) and exact resume.

Every run's `samples.jsonl` must account for each sample id exactly once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    MILES,
    TEST_MODULES,
    _test_env,
    read_jsonl,
    run_miles,
    shared_ray,
    write_config,
)

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

P, N = 4, 4  # prompts per step, samples per prompt (write_config's defaults)


def _run(tmp_path: Path, assets: dict[str, str], name: str, **sections: Any) -> Path:
    cfg = write_config(tmp_path / f"{name}.yaml", assets, **sections)
    run_dir = tmp_path / name
    proc = run_miles("run", str(cfg), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def _assert_every_sample_once(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    ledger = read_jsonl(run_dir / "samples.jsonl")
    ids = [row["sample_id"] for row in ledger]
    assert len(ids) == len(set(ids)), "a sample id was recorded twice"
    trained = [row for row in ledger if row["fate"] == "trained"]
    assert len(trained) == steps * P * N  # no filters: every sample is trained
    assert sorted(ids) == list(range(len(ids)))  # none lost: ids are handed out densely
    return ledger


# The uninterrupted runs that several tests read (each also the reference a killed and resumed
# run must match): made once per module.
WHOLE_STEPS = 5
ONE_STEP_OFF: dict[str, Any] = {"mode": "one_step_off", "algorithm": {"correction": "tis"}}
CHECKPOINTED: dict[str, Any] = {"checkpoint": {"every": 1, "keep_last": 2}}


@pytest.fixture(scope="module")
def whole_sync(tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, str]) -> Path:
    """5 steps in sync mode, a checkpoint after each."""
    root = tmp_path_factory.mktemp("whole-sync")
    return _run(root, tiny_assets, "whole", steps=WHOLE_STEPS, **CHECKPOINTED)


@pytest.fixture(scope="module")
def whole_one_step_off(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, str]
) -> Path:
    """5 steps in one_step_off mode, a checkpoint after each."""
    root = tmp_path_factory.mktemp("whole-off")
    return _run(root, tiny_assets, "whole", steps=WHOLE_STEPS, **ONE_STEP_OFF, **CHECKPOINTED)


def test_one_step_off_trains_one_version_behind(whole_one_step_off: Path) -> None:
    rows = read_jsonl(whole_one_step_off / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, WHOLE_STEPS + 1))
    # Batch 0 is on-policy; every later batch was generated while the step before it trained.
    assert [r["async/staleness_mean"] for r in rows] == [0.0] + [1.0] * (WHOLE_STEPS - 1)
    for row in rows:
        assert {
            "async/buffer_fill",
            "perf/trainer_idle_frac",
            "perf/rollout_idle_frac",
        } <= row.keys()
    _assert_every_sample_once(whole_one_step_off, WHOLE_STEPS)


def test_two_train_ranks_match_one(
    tmp_path: Path, tiny_assets: dict[str, str], whole_sync: Path
) -> None:
    """FSDP2 over 2 gloo ranks inside Ray: same data, same seed, same metrics as 1 rank (the
    whole_sync run's first steps: its checkpoints change nothing it computes)."""
    two = read_jsonl(
        _run(
            tmp_path,
            tiny_assets,
            "two-ranks",
            train={"world_size": 2},
            checkpoint={"at_end": False},
        )
        / "metrics.jsonl"
    )
    one = read_jsonl(whole_sync / "metrics.jsonl")[: len(two)]
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert b["rollout/reward_mean"] == a["rollout/reward_mean"]
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("on_update", ["continue", "requeue"])
def test_async_updates_weights_mid_generation(
    tmp_path: Path, tiny_assets: dict[str, str], on_update: str
) -> None:
    """A slow engine is still generating when new weights arrive: its requests either finish
    with the new weights (tokens of two versions in one sample) or start again."""
    run_dir = _run(
        tmp_path,
        tiny_assets,
        on_update,
        mode="async",
        steps=4,
        algorithm={"correction": "tis"},
        rollout={"backend": "chaos_torch", "step_delay_s": 0.05, "max_new_tokens": 12},
        **{"async": {"max_staleness": 1, "on_weight_update": on_update}},
        checkpoint={"at_end": False},
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 4
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert sum(r["async/requeued"] for r in rows) > 0  # updates did cut requests short
    ledger = _assert_every_sample_once(run_dir, 4)
    mixed = [row for row in ledger if row["weight_versions"][0] != row["weight_versions"][1]]
    if on_update == "continue":
        assert mixed, "no sample spans a weight update"
    else:
        assert not mixed


@pytest.mark.parametrize("offload", ["auto", "never"])
def test_colocated_engine_shares_the_trainer_bundle(
    tmp_path: Path, tiny_assets: dict[str, str], offload: str
) -> None:
    """Engine and trainer share one bundle; weights go by handle (IPC on GPU), and the run
    checks after every sync that the engine holds exactly the trainer's weights. The hand-over
    offloads or not as `offload` says (auto without a GPU: as always)."""
    run_dir = _run(tmp_path, tiny_assets, "colo", placement="colocated", steps=3, offload=offload)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["weights/version"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/rollout_logprob_abs_diff"] < 1e-4
    events = (run_dir / "events.jsonl").read_text()
    layout = next(e["layout"] for e in read_jsonl(run_dir / "events.jsonl") if "layout" in e)
    assert [(p["role"], p["bundle"]) for p in layout] == [("train", 0), ("engine", 0)]
    assert f'"offload": {"false" if offload == "never" else "true"}' in events
    _assert_every_sample_once(run_dir, 3)


def _chaos_marker(tmp_path: Path) -> str:
    return str(tmp_path / "fault-happened")


def test_killed_engine_is_restarted_and_its_requests_move(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "kill-engine",
        steps=3,
        rollout={"backend": "chaos_torch", "engines": 2, "fault": "kill", "marker": marker},
        fault={"backoff_s": 0.1},
        checkpoint={"at_end": False},
    )
    assert Path(marker).exists()  # the fault did fire
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 3
    assert rows[-1]["fault/engine_restarts"] == 1
    _assert_every_sample_once(run_dir, 3)


def test_a_checkpoint_waiting_on_generation_brings_a_restarted_engine_in(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """Async, one engine, killed mid-generation while the (slow) trainer trains: the weight sync
    goes ahead without it, and the checkpoint that follows waits for the batches in flight,
    which only the restarted engine can make, once a weight sync brings it in. The wait re-sends
    the current weights (it used to wait forever: found by the chaos test)."""
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "ckpt-wait",
        mode="async",
        steps=4,
        algorithm={"correction": "tis"},
        rollout={"backend": "chaos_torch", "engines": 1, "fault": "kill", "marker": marker},
        train={"backend": "chaos_fsdp", "step_delay_s": 2.0},
        fault={"backoff_s": 0.1},
        checkpoint={"every": 1},
    )
    assert Path(marker).exists()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 4 and rows[-1]["fault/engine_restarts"] == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step_4"
    ledger = read_jsonl(run_dir / "samples.jsonl")
    ids = [row["sample_id"] for row in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))


def test_hung_engine_is_caught_by_the_timeout(tmp_path: Path, tiny_assets: dict[str, str]) -> None:
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "hang-engine",
        steps=3,
        rollout={"backend": "chaos_torch", "fault": "hang", "marker": marker},
        fault={"request_timeout_s": 5, "backoff_s": 0.1},
        checkpoint={"at_end": False},
    )
    assert Path(marker).exists()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 3
    assert rows[-1]["fault/engine_restarts"] == 1
    events = (run_dir / "events.jsonl").read_text()
    assert "fault.request_timeout_s" in events  # the reason names the setting that caught it
    _assert_every_sample_once(run_dir, 3)


def _fault_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("fault") == kind]


def test_killed_train_rank_restarts_from_the_checkpoint(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "kill-train",
        steps=4,
        train={"backend": "chaos_fsdp", "kill_at_train_step": 3, "marker": marker},
        fault={"backoff_s": 0.1, "snapshot_every": 0},
        checkpoint={"every": 1},
    )
    assert Path(marker).exists()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["fault/train_restarts"] for r in rows] == [0, 0, 1, 1]
    [restored] = _fault_events(run_dir, "train_restarted")
    assert restored["restored"] == "the checkpoint of step 2" and restored["steps_redone"] == 0
    _assert_every_sample_once(run_dir, 4)


def test_a_train_restart_resumes_from_the_snapshot_and_redoes_the_steps_exactly(
    tmp_path: Path, tiny_assets: dict[str, str], whole_sync: Path
) -> None:
    """Snapshots every 2 steps, no checkpoint: the train group dies in step 3's training, comes
    back from step 1's snapshot, trains step 2 again on its batch, then step 3. Every metric
    matches an unharmed run of the same seed (checkpoints change nothing it computes): nothing
    was lost or trained twice."""
    sections: dict[str, Any] = {
        "steps": WHOLE_STEPS,
        "fault": {"backoff_s": 0.1, "snapshot_every": 2},
        "checkpoint": {"at_end": False},
    }
    whole = whole_sync
    marker = _chaos_marker(tmp_path)
    train = {"backend": "chaos_fsdp", "kill_at_train_step": 4, "marker": marker}
    run_dir = _run(tmp_path, tiny_assets, "killed", train=train, **sections)
    assert Path(marker).exists()
    [restored] = _fault_events(run_dir, "train_restarted")
    assert restored["restored"] == "the snapshot of step 2" and restored["step"] == 4
    assert restored["steps_redone"] == 1 and restored["lost_training"] is False
    got, expected = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(whole / "metrics.jsonl")
    assert got[-1]["fault/steps_redone"] == 1 and got[-1]["fault/train_restarts"] == 1
    for want, have in zip(expected, got, strict=True):
        for key in want:
            if not key.startswith("fault/") and key in _comparable(want):
                assert have[key] == pytest.approx(want[key], abs=1e-6, rel=0), (want["step"], key)
    _assert_every_sample_once(run_dir, 5)


@pytest.mark.parametrize("restart_from", ["latest", "base"])
def test_with_nothing_to_restore_a_train_loss_fails_unless_base_is_allowed(
    tmp_path: Path, tiny_assets: dict[str, str], restart_from: str
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=4,
        train={"backend": "chaos_fsdp", "kill_at_train_step": 3, "marker": _chaos_marker(tmp_path)},
        fault={"backoff_s": 0.1, "snapshot_every": 0, "train_restart_from": restart_from},
        checkpoint={"at_end": False},
    )
    run_dir = tmp_path / "run"
    proc = run_miles("run", str(cfg), "--run-dir", str(run_dir))
    if restart_from == "latest":
        assert proc.returncode == 1
        assert "its training cannot be restored" in proc.stderr
        assert "fault.train_restart_from: base" in proc.stderr
        assert "Traceback" not in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-4000:]
        [restored] = _fault_events(run_dir, "train_restarted")
        assert restored["lost_training"] is True and restored["restored"] == "the base model"
        assert "faults survived: 1 train restart" in proc.stdout  # the run's summary


def test_an_engine_killed_in_a_weight_sync_is_replaced_and_the_sync_redone(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    marker = _chaos_marker(tmp_path)
    rollout = {"backend": "chaos_torch", "engines": 2, "kill_at_receive": 2, "marker": marker}
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "kill-in-sync",
        steps=3,
        rollout=rollout,
        fault={"backoff_s": 0.1},
        checkpoint={"at_end": False},
    )
    assert Path(marker).exists()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # rollout.verify_weights (on): after each sync every engine's checksum is the trainer's.
    assert [r["weights/version"] for r in rows] == [1, 2, 3]
    assert rows[-1]["fault/engine_restarts"] == 1
    assert [e["engine"] for e in _fault_events(run_dir, "engine_restarted")] in ([0], [1])
    _assert_every_sample_once(run_dir, 3)


def test_an_engine_corrupted_after_a_sync_gets_the_weights_again_before_generating(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """One engine's weights change after a sync (a real tensor, not a faked report): the
    verification sees it, the weights are sent again, and no sample comes from the corrupted
    weights (the chaos engine notes any generate call made while they are in place)."""
    marker = _chaos_marker(tmp_path)
    rollout = {"backend": "chaos_torch", "engines": 2, "corrupt_at_receive": 2, "marker": marker}
    run_dir = _run(tmp_path, tiny_assets, "corrupt", steps=3, rollout=rollout)
    assert Path(marker).exists()  # the corruption happened
    assert not Path(marker + ".generated-corrupt").exists(), "generated from corrupted weights"
    [resent] = [
        e for e in read_jsonl(run_dir / "events.jsonl") if e["event"].startswith("engines hold")
    ]
    assert "weight sync verification failed at version 2: engine " in resent["error"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["weights/version"] for r in rows] == [1, 2, 3]
    _assert_every_sample_once(run_dir, 3)


def test_past_the_restart_cap_the_run_fails_clearly(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=3,
        train={"backend": "chaos_fsdp", "kill_at_train_step": 2, "marker": _chaos_marker(tmp_path)},
        fault={"max_train_restarts": 0},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1
    assert "fault.max_train_restarts=0" in proc.stderr
    assert "Traceback" not in proc.stderr


@contextlib.contextmanager
def _background_run(
    cfg: Path, run_dir: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`miles run` in the background; killed with everything it started (Ray included) on exit."""
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(TEST_MODULES), **(env or {})}
    proc = subprocess.Popen(
        [*MILES, "run", str(cfg), "--run-dir", str(run_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: Ray's processes die with it
    )
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ── exact resume ─────────────────────────────────────────────────────────────────────────────────


# Wall-clock measurements differ between any two runs; everything else must not.
def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith("perf/") and not k.endswith(("_s", "_per_s"))
    }


def test_resume_after_a_kill_matches_an_uninterrupted_run(
    tmp_path: Path, tiny_assets: dict[str, str], whole_sync: Path
) -> None:
    steps, kill_after = WHOLE_STEPS, 2
    sections: dict[str, Any] = {"steps": steps, **CHECKPOINTED}
    whole = whole_sync

    cfg = write_config(tmp_path / "killed.yaml", tiny_assets, **sections)
    run_dir = tmp_path / "killed"
    with _background_run(cfg, run_dir) as proc:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / f"step_{kill_after}").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    done = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(done) < steps, "killed too late to test anything"

    resumed = run_miles("run", "--resume", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = [_comparable(r) for r in read_jsonl(whole / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], abs=1e-6, rel=0), (want["step"], key)
    _assert_every_sample_once(run_dir, steps)


def _interrupted_run(cfg: Path, run_dir: Path, presses: int) -> tuple[int, list[str]]:
    """`miles run CFG` on the shared Ray, Ctrl-C'd `presses` times (to its process group, as a
    terminal does) once its first step is in metrics.jsonl, a later press once the run has said
    it heard the one before: (exit code, stderr lines)."""
    env = {**_test_env(), "RAY_AUTH_MODE": "token"}
    args = [*MILES, "run", str(cfg), "--run-dir", str(run_dir), "--ray-address", shared_ray()]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and read_jsonl(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.02)
        for press in range(presses):
            if press:  # two presses before the run handles one would arrive as one signal
                while not any(x.startswith("interrupt: ") for x in lines):
                    assert time.monotonic() < deadline, "".join(lines)[-3000:]
                    time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, [x.rstrip("\n") for x in lines]


def test_ctrl_c_saves_a_checkpoint_and_the_printed_command_resumes_exactly(
    tmp_path: Path, tiny_assets: dict[str, str], whole_sync: Path
) -> None:
    """The audit: Ctrl-C printed a resume command that failed (no checkpoint: the run saves one
    only at its end), and the report called the run finished. Now the first Ctrl-C finishes the
    step in flight, checkpoints it and stops; the printed command resumes it, and the whole
    equals a run never interrupted."""
    cfg = write_config(tmp_path / "run.yaml", tiny_assets, steps=WHOLE_STEPS)  # no checkpoint.every
    run_dir = tmp_path / "run"
    code, err = _interrupted_run(cfg, run_dir, presses=1)
    assert code == 130, err[-30:]
    done = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert 1 <= done < WHOLE_STEPS, "interrupted too late to test anything"
    # Each message on a line of its own, and the checkpoint of the last step there.
    assert any(line.startswith("interrupt: finishing step ") for line in err), err[-30:]
    assert f"interrupted after step {done} of {WHOLE_STEPS}; checkpoint saved: " in "\n".join(err)
    command = next(line for line in err if line.startswith("resume with: "))
    assert command == f"resume with: miles run --resume --run-dir {run_dir}"
    assert (run_dir / "checkpoints" / f"step_{done}" / "state.json").is_file()
    [event] = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "run interrupted"]
    assert event["steps_done"] == done and event["steps"] == WHOLE_STEPS
    report = run_miles("report", str(run_dir))
    assert report.returncode == 0, report.stderr[-3000:]
    page = (run_dir / "report" / "index.html").read_text()
    assert "badge interrupted" in page and f"stopped by Ctrl-C after step {done}" in page

    resumed = run_miles(*command.removeprefix("resume with: miles ").split())
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = [_comparable(r) for r in read_jsonl(whole_sync / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in got] == list(range(1, WHOLE_STEPS + 1))
    for want, have in zip(expected, got, strict=True):
        for key in want:
            assert have[key] == pytest.approx(want[key], abs=1e-6, rel=0), (want["step"], key)


def test_a_second_ctrl_c_stops_at_once_and_says_what_was_lost(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    slow = {"name": "miles_test_rewards:slow_vowels"}  # a step of a second or more
    cfg = write_config(tmp_path / "run.yaml", tiny_assets, steps=WHOLE_STEPS, reward=slow)
    run_dir = tmp_path / "run"
    code, err = _interrupted_run(cfg, run_dir, presses=2)
    assert code == 130, err[-30:]
    said = "\n".join(err)
    assert "stopped at once after step " in said and "was in flight and is lost" in said, said
    assert "no checkpoint was saved: start again with another --run-dir" in said, said
    assert "Traceback" not in said, said[-3000:]
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "run interrupted"]
    assert events and events[-1]["at_once"] is True


def test_resume_skips_a_corrupt_checkpoint(tmp_path: Path, whole_sync: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(whole_sync, run_dir)  # checkpoints step_4 and step_5 (keep_last 2)
    newest = run_dir / "checkpoints" / f"step_{WHOLE_STEPS}" / "train" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the weights
    newest.write_bytes(bytes(data))
    steps = WHOLE_STEPS + 1
    proc = run_miles("run", "--resume", "--run-dir", str(run_dir), "--set", f"steps={steps}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Said where a person looks: the final summary, and the report's faults table.
    skipped = f"step_{WHOLE_STEPS}"
    assert (
        f"resumed from step_{WHOLE_STEPS - 1}, skipping {skipped} (sha256 mismatch in "
        "train/model.safetensors): 1 step trained again" in proc.stdout
    ), proc.stdout[-3000:]
    [event] = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("fault")]
    assert event["fault"] == "checkpoint_skipped" and event["steps_lost"] == 1
    report = run_miles("report", str(run_dir))
    assert report.returncode == 0, report.stderr[-3000:]
    page = (run_dir / "report" / "index.html").read_text()
    assert f"checkpoint {skipped} skipped (sha256 mismatch" in page
    # Resumed from step_3: step 4 is done again, then step 5.
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))


def test_local_ray_refuses_clients_without_the_token(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """The Ray that `miles run` starts has token authentication on, its token file (made by the
    run) is readable by its user only, and RAY_AUTH_MODE=disabled cannot turn it off."""
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=50,
        rollout={"backend": "chaos_torch", "step_delay_s": 0.5},  # a slow run to talk to
    )
    run_dir = tmp_path / "run"
    token = tmp_path / "ray" / "auth_token"  # not there yet: the run makes it
    refused = run_miles(
        "run", str(cfg), "--run-dir", str(tmp_path / "open"),
        env={"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(token)},
    )  # fmt: skip
    assert refused.returncode == 2 and "RAY_AUTH_MODE=disabled" in refused.stderr
    assert not token.exists() and not (tmp_path / "open").exists()
    env = {"RAY_AUTH_TOKEN_PATH": str(token)}
    with _background_run(cfg, run_dir, env) as proc:
        deadline = time.monotonic() + 120
        started: list[dict[str, Any]] = []
        while not started:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
            if (run_dir / "events.jsonl").exists():
                events = read_jsonl(run_dir / "events.jsonl")
                started = [e for e in events if e["event"] == "local Ray started"]
        assert started[0]["auth"] == "token"
        assert token.stat().st_mode & 0o777 == 0o600
        connect = f"import ray; ray.init(address={started[0]['address']!r}); print('connected')"
        plain_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}

        def client(home: str, *path: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", connect],
                env={
                    **plain_env,
                    "HOME": home,
                    "RAY_AUTH_MODE": "token",
                    **({"RAY_AUTH_TOKEN_PATH": path[0]} if path else {}),
                },
                capture_output=True,
                text=True,
                timeout=120,
            )

        with_token = client(os.environ.get("HOME", "/root"), str(token))
        assert "connected" in with_token.stdout, with_token.stderr[-2000:]
        stranger = tmp_path / "stranger"  # no ~/.ray/auth_token
        stranger.mkdir()
        refused = client(str(stranger))
        assert "connected" not in refused.stdout
        assert "token" in refused.stderr.lower()


@pytest.mark.parametrize("stale", ["drop", "regenerate"])
def test_async_samples_too_old_after_a_train_restart(
    tmp_path: Path, tiny_assets: dict[str, str], stale: str
) -> None:
    """The train group dies at step 3 with nothing to restore, and (as allowed) goes back to
    the base model, whose weights go to the engines as a new version: the batch made ahead
    with the lost weights is now two versions behind, so it is dropped, or generated again."""
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        stale,
        mode="async",
        steps=5,
        algorithm={"correction": "tis"},
        train={"backend": "chaos_fsdp", "kill_at_train_step": 4, "marker": marker},
        **{"async": {"max_staleness": 1, "stale": stale}},
        fault={"backoff_s": 0.1, "snapshot_every": 0, "train_restart_from": "base"},
        checkpoint={"at_end": False},
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 5 and rows[-1]["fault/train_restarts"] == 1
    assert all(r["async/staleness_max"] <= 1 for r in rows)  # nothing older was trained
    ledger = read_jsonl(run_dir / "samples.jsonl")
    ids = [row["sample_id"] for row in ledger]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(len(ids)))
    fates = {row["fate"] for row in ledger}
    if stale == "drop":
        assert sum(r["async/stale_groups"] for r in rows) > 0
        assert "stale" in fates
        assert rows[-1]["samples/stale"] == sum(row["fate"] == "stale" for row in ledger)
    else:
        assert sum(r["async/stale_regenerated"] for r in rows) > 0
        assert fates == {"trained"} and len(ids) == 5 * P * N


def test_an_engine_past_its_restart_cap_fails_the_run_clearly(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=3,
        rollout={"backend": "chaos_torch", "fault": "kill", "marker": _chaos_marker(tmp_path)},
        fault={"max_engine_restarts": 0},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1
    assert "rollout engine 0 failed" in proc.stderr
    assert "fault.max_engine_restarts=0" in proc.stderr
    assert "no rollout engine is left" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_engine_past_its_restart_cap_is_dropped_and_the_run_goes_on(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "drop",
        steps=3,
        rollout={"backend": "chaos_torch", "engines": 2, "fault": "kill", "marker": marker},
        fault={"max_engine_restarts": 0},
        checkpoint={"at_end": False},
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["fault/engines_dropped"] == 1 and rows[-1]["fault/engine_restarts"] == 0
    assert len(_fault_events(run_dir, "engine_dropped")) == 1
    _assert_every_sample_once(run_dir, 3)


# ── resume in the overlapping modes: the batches in flight are saved with the checkpoint ───────


def _kill_after_checkpoint(cfg: Path, run_dir: Path, step: int) -> dict[str, Any]:
    """Runs `cfg` in the background, kills it (SIGKILL) once checkpoint `step` exists, and returns
    the newest checkpoint's state.json: what `--resume` starts from."""
    import json

    with _background_run(cfg, run_dir) as proc:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / f"step_{step}").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    newest = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    return json.loads((newest / "state.json").read_text())  # type: ignore[no-any-return]


def test_one_step_off_resume_restores_the_batch_in_flight_exactly(
    tmp_path: Path, tiny_assets: dict[str, str], whole_one_step_off: Path
) -> None:
    """In one_step_off, each checkpoint holds the next step's batch (generated with the weights
    before it): resumed, the run trains that very batch, one version behind, and matches an
    uninterrupted run metric for metric."""
    steps = WHOLE_STEPS
    sections: dict[str, Any] = {"steps": steps, **ONE_STEP_OFF, **CHECKPOINTED}
    whole = whole_one_step_off
    run_dir = tmp_path / "killed"
    state = _kill_after_checkpoint(
        write_config(tmp_path / "k.yaml", tiny_assets, **sections), run_dir, 2
    )
    assert state["step"] < steps, "killed too late to test anything"
    assert len(state["rollout"]["buffer"]) > 0, "the checkpoint holds no batch in flight"

    resumed = run_miles("run", "--resume", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = [_comparable(r) for r in read_jsonl(whole / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["async/staleness_mean"] for r in got] == [0.0] + [1.0] * (steps - 1)
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], abs=1e-6, rel=0), (want["step"], key)
    _assert_every_sample_once(run_dir, steps)


def test_async_resume_trains_the_buffered_samples_and_loses_none(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """In async mode the checkpoint saves the samples streamed into the buffer but not yet
    trained; resumed, those are trained (none generated twice, none lost) within the staleness
    bound."""
    steps = 5
    sections: dict[str, Any] = {
        "steps": steps,
        "mode": "async",
        "algorithm": {"correction": "tis"},
        "async": {"max_staleness": 2},
        "checkpoint": {"every": 1, "keep_last": 2},
    }
    run_dir = tmp_path / "killed"
    state = _kill_after_checkpoint(
        write_config(tmp_path / "k.yaml", tiny_assets, **sections), run_dir, 2
    )
    assert state["step"] < steps, "killed too late to test anything"
    assert len(state["rollout"]["buffer"]) > 0, "the checkpoint holds no buffered samples"

    resumed = run_miles("run", "--resume", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["async/staleness_max"] <= 2 for r in rows)
    ledger = _assert_every_sample_once(run_dir, steps)
    # The step after the checkpoint trained samples created before it: restored, not redone.
    restored_ids = {s["sample_id"] for b in state["rollout"]["buffer"] for s in b["samples"]}
    after = {r["sample_id"] for r in ledger if r["step"] == state["step"] + 1}
    assert restored_ids & after, "the resumed run did not train the restored samples"


def test_a_train_group_lost_in_the_warm_start_redoes_it_on_the_same_batches(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """The train rank dies in warm-start step 2: the new group starts from model.path and trains
    step 1 again on its batch before going on; nothing of the warm-start is lost."""
    marker = _chaos_marker(tmp_path)
    run_dir = _run(
        tmp_path,
        tiny_assets,
        "warm",
        steps=2,
        warmstart={
            "data": tiny_assets["data"],
            "steps": 3,
            "batch_size": 4,
            "response_key": "answer",
        },
        train={"backend": "chaos_fsdp", "kill_at_train_step": 2, "marker": marker},
        fault={"backoff_s": 0.1},
        checkpoint={"at_end": False},
    )
    assert Path(marker).exists()
    [restored] = _fault_events(run_dir, "train_restarted")
    assert restored["restored"] == "the base model (warm-start)"
    assert restored["steps_redone"] == 1 and restored["lost_training"] is False
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["fault/steps_redone"] == 1 and rows[-1]["fault/train_restarts"] == 1
    _assert_every_sample_once(run_dir, 2)


def test_resume_refuses_a_checkpoint_numbered_the_old_way(tmp_path: Path, whole_sync: Path) -> None:
    """Checkpoints named by the step's 0-based index (before steps were numbered from 1) would
    resume one step off: refused, with the reason, before anything starts."""
    import json

    from miles.runtime.rundir import _write_checksums

    run_dir = tmp_path / "run"
    shutil.copytree(whole_sync, run_dir)
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        state = json.loads((checkpoint / "state.json").read_text())
        state.pop("numbering")
        (checkpoint / "state.json").write_text(json.dumps(state))
        _write_checksums(checkpoint)  # a sound checkpoint, only of the earlier numbering
    proc = run_miles("run", "--resume", "--run-dir", str(run_dir), "--set", "steps=6")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "numbered steps from 0" in proc.stderr and "Traceback" not in proc.stderr
