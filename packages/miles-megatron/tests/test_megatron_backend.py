"""The `megatron` train backend on gloo CPU ranks (megatron-core through miles.megatron.testing's
shims), against the `fsdp` backend on one rank: the same batch, loss and optimizer settings give
the same logprobs, metrics and weights at TP=2 and PP=2; a TP=2 checkpoint resumes on one rank
exactly; the weights sync into a native engine with equal checksums."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from miles.core.contracts.types import PackedBatch, Sample
from miles.runtime.cluster.process import free_port
from miles.torch.testing import make_tiny_model
from miles.torch.train.microbatch import plan_micro_batches

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).with_name("megatron_backend_worker.py")
VOCAB = 300  # not a multiple of 128: Megatron's padded vocabulary rows are exercised
SHAPES = [(3, 6), (8, 1), (1, 0), (5, 20), (4, 4), (2, 9)]
BUDGET = 12  # the worker's micro_batch_tokens


def make_batch() -> PackedBatch:
    """Random tokens (padding id 0 among them); old logprobs are perturbed around a plausible
    value so that some ratios clip; sequence-mean weights, not the default token mean."""
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, VOCAB, p).tolist(),
            response_ids=rng.integers(0, VOCAB, r).tolist(),
            sample_id=i,
        )
        for i, (p, r) in enumerate(SHAPES)
    ]
    batch = PackedBatch.from_samples(samples, advantages=[1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    noise = 0.3 * rng.standard_normal(len(batch.tokens)).astype(np.float32)
    batch.old_logprobs = (np.float32(-np.log(VOCAB)) + noise).astype(np.float32)
    weights = np.zeros_like(batch.loss_mask)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        mask = batch.loss_mask[lo:hi]
        weights[lo:hi] = mask / max(mask.sum(), 1.0) / len(batch)
    batch.loss_weights = weights
    return batch


def run_ranks(
    backend: str,
    layout: str,
    model: str,
    batch: Path,
    out: Path,
    world: int,
    resume: str = "",
    device: str = "cpu",
) -> None:
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_TEST_DEVICE": device}
    args = [backend, layout, model, str(batch), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args, str(rank), str(world), port]
            + ([resume] if resume else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"{backend} {layout} rank {rank} failed:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fsdp on one rank; megatron at TP=2 and PP=2 on two; TP=2's checkpoint resumed on one."""
    root = tmp_path_factory.mktemp("megatron_backend")
    # Untied head: megatron-core sets up a tied output layer on the last stage on CUDA only.
    model = make_tiny_model(root / "tiny", arch="qwen3", vocab_size=VOCAB)
    batch = make_batch()
    # An odd number of micro-batches: a data-parallel rank tops up with a padding one.
    assert len(plan_micro_batches(batch.seq_lens, BUDGET)) % 2 == 1
    batch_file = root / "batch.npz"
    np.savez(batch_file, **{k: v for k, v in vars(batch).items() if v is not None})
    run_ranks("fsdp", "tp1", model, batch_file, root / "fsdp", world=1)
    run_ranks("megatron", "tp2", model, batch_file, root / "tp2", world=2)
    run_ranks("megatron", "pp2", model, batch_file, root / "pp2", world=2)
    resume = str(root / "tp2" / "ckpt")
    run_ranks("megatron", "tp1", model, batch_file, root / "resumed", world=1, resume=resume)
    return root


def _summary(root: Path, run: str, rank: int = 0) -> dict:
    return json.loads((root / run / f"metrics_rank{rank}.json").read_text())


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_megatron_ranks_train_as_fsdp_does(runs: Path, layout: str) -> None:
    ours, theirs = _summary(runs, layout), _summary(runs, "fsdp")
    assert ours["metrics"] == _summary(runs, layout, 1)["metrics"]  # every rank reports alike
    for mine, ref in zip(ours["metrics"], theirs["metrics"], strict=True):
        assert mine.keys() == ref.keys()
        for key in ref:
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert 0.0 < theirs["metrics"][0]["train/clipfrac"] < 1.0  # the loss's clipping is exercised
    mine_w, ref_w = (
        load_file(runs / layout / "result.safetensors"),
        load_file(runs / "fsdp" / "result.safetensors"),
    )
    assert mine_w.keys() == ref_w.keys()
    for name in ref_w:
        torch.testing.assert_close(mine_w[name], ref_w[name], rtol=1e-5, atol=2e-6, msg=name)
    # The synced engine holds exactly the trainer's weights.
    assert ours["sync_checksum_equal"] is True


def test_a_tp2_checkpoint_resumes_on_one_rank_exactly(runs: Path) -> None:
    resumed, tp2 = _summary(runs, "resumed")["metrics"], _summary(runs, "tp2")["metrics"]
    assert resumed[0] == pytest.approx(tp2[2], rel=1e-5, abs=1e-6)
    ours, ref = (
        load_file(runs / "resumed" / "result.safetensors"),
        load_file(runs / "tp2" / "result.safetensors"),
    )
    for name in ref:
        if not name.startswith("__"):
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # The checkpoint is a Hugging Face checkpoint of the fp32 main weights, safetensors only.
    files = sorted(p.name for p in (runs / "tp2" / "ckpt").iterdir())
    assert "model.safetensors" in files and "optimizer.safetensors" in files, files
    assert not [f for f in files if f.endswith((".pt", ".bin", ".pkl", ".distcp"))], files


# GPU-only (bf16 and the distributed optimizer exist on CUDA alone); last run: see docs/testing.md.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_megatron_on_a_gpu_trains_as_fsdp_does_in_bf16(tmp_path: Path) -> None:
    """One GPU, bf16 compute over fp32 main weights on both sides (megatron: its distributed
    optimizer and DDP buffers): the same logprobs and metrics to bf16's precision, and a
    checkpoint that resumes exactly. (The sync into an engine runs across processes, over CUDA
    IPC, in the colocated quickstart.)"""
    model = make_tiny_model(tmp_path / "tiny", arch="qwen3", vocab_size=VOCAB)
    batch_file = tmp_path / "batch.npz"
    np.savez(batch_file, **{k: v for k, v in vars(make_batch()).items() if v is not None})
    for backend in ("fsdp", "megatron"):
        run_ranks(backend, "tp1", model, batch_file, tmp_path / backend, 1, device="cuda")
    resume = str(tmp_path / "megatron" / "ckpt")
    run_ranks("megatron", "tp1", model, batch_file, tmp_path / "resumed", 1, resume, "cuda")
    ours, theirs = _summary(tmp_path, "megatron"), _summary(tmp_path, "fsdp")
    print(ours, theirs)
    mine_w, ref_w = (load_file(tmp_path / r / "result.safetensors") for r in ("megatron", "fsdp"))
    lp_diff = (mine_w["__logprobs__"] - ref_w["__logprobs__"]).abs().max().item()
    assert lp_diff < 0.05, lp_diff  # bf16 forward through different kernels
    for mine, ref in zip(ours["metrics"], theirs["metrics"], strict=True):
        assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=0.05, abs=1e-3)
        assert mine["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=0.05)
    resumed = _summary(tmp_path, "resumed")["metrics"][0]
    assert resumed == pytest.approx(ours["metrics"][2], rel=1e-3, abs=1e-4)
