"""Two FSDP2 ranks (gloo, separate processes) compute what one rank does, and checkpoints made
by two ranks resume on one."""

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
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import PackedBatch, Sample
from miles.runtime.cluster.process import free_port
from miles.torch.testing import make_tiny_model
from miles.torch.train.microbatch import plan_micro_batches

WORKER = Path(__file__).with_name("fsdp_dist_worker.py")
VOCAB = 128
SHAPES = [(3, 6), (8, 1), (1, 0), (5, 20), (4, 4), (2, 9)]
BUDGET = 12  # the worker's micro_batch_tokens


def make_batch(model_path: str) -> PackedBatch:
    """Random tokens; old logprobs are the model's own, perturbed so that some ratios clip."""
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
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    old = np.zeros(len(batch.tokens), dtype=np.float32)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        ids = torch.from_numpy(batch.tokens[lo:hi])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
        old[lo + 1 : hi] = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()
    batch.old_logprobs = old + 0.3 * rng.standard_normal(old.shape).astype(np.float32)
    # Sequence-mean aggregation, so the weights are not the default token mean.
    weights = np.zeros_like(batch.loss_mask)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        mask = batch.loss_mask[lo:hi]
        weights[lo:hi] = mask / max(mask.sum(), 1.0) / len(batch)
    batch.loss_weights = weights
    return batch


def run_ranks(
    device: str, model: str, batch_file: Path, out: Path, world: int, resume: str = ""
) -> None:
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                device,
                model,
                str(batch_file),
                str(out),
                str(rank),
                str(world),
                port,
                *([resume] if resume else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"rank {rank} of {world} failed:\n{log[-4000:]}"


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
            ],
        ),
    ],
)
def test_two_ranks_match_one_rank(device, tmp_path):
    model = make_tiny_model(tmp_path / "tiny", arch="qwen3", vocab_size=VOCAB)
    batch = make_batch(model)
    # An odd number of micro-batches: rank 1 runs a padding micro-batch.
    assert len(plan_micro_batches(batch.seq_lens, BUDGET)) % 2 == 1
    batch_file = tmp_path / "batch.npz"
    np.savez(batch_file, **{k: v for k, v in vars(batch).items() if v is not None})

    run_ranks(device, model, batch_file, tmp_path / "two", world=2)
    run_ranks(device, model, batch_file, tmp_path / "one", world=1)
    resume = str(tmp_path / "two" / "ckpt")
    run_ranks(device, model, batch_file, tmp_path / "resumed", world=1, resume=resume)

    def metrics(run: str, rank: int = 0) -> list[dict[str, float]]:
        return json.loads((tmp_path / run / f"metrics_rank{rank}.json").read_text())

    def result(run: str) -> dict[str, torch.Tensor]:
        return load_file(tmp_path / run / "result.safetensors")

    assert metrics("two", 0) == metrics("two", 1)  # every rank reports the same numbers
    for two, one in zip(metrics("two"), metrics("one"), strict=True):
        assert two.keys() == one.keys()
        for key in two:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert 0.0 < metrics("one")[0]["train/clipfrac"] < 1.0

    two, one, resumed = result("two"), result("one"), result("resumed")
    assert two.keys() == one.keys() == resumed.keys()
    initial = dict(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).named_parameters()
    )
    assert max((one[k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # it trained
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
        # A 2-rank checkpoint resumes on 1 rank: the third step lands where the 2-rank one did.
        torch.testing.assert_close(resumed[name], two[name], rtol=1e-5, atol=1e-6, msg=name)
    assert metrics("resumed")[0] == pytest.approx(metrics("two")[2], rel=1e-5, abs=1e-7)
