"""`HostAdamW` (`train.optimizer_offload`): torch's AdamW stepped a chunk of parameters at a time,
its moments resting in host memory between steps."""

from __future__ import annotations

import pytest
import torch

from miles.torch.train.host_adamw import HostAdamW


def _params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (4, 4), (1,), (9, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _run(optimizer_of, device: str = "cpu") -> tuple[list[torch.Tensor], dict]:
    params = _params(0, device)
    opt = optimizer_of(params)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        for group in opt.param_groups:  # the schedule sets the lr between steps
            group["lr"] = 1e-2 * (step + 1)
        opt.step()
    return [p.detach().clone() for p in params], opt.state


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize("chunk", [1, 8, 30, 10**6])
def test_chunked_steps_equal_adamw(chunk: int) -> None:
    """Chunks that cut a parameter list anywhere (one parameter each, mid-list, all at once)
    give AdamW's weights and state exactly, with the lr changed between steps."""
    want, want_state = _run(lambda ps: torch.optim.AdamW(ps, **ADAMW))
    got, got_state = _run(lambda ps: HostAdamW(ps, chunk_params=chunk, **ADAMW))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got_state.values(), want_state.values(), strict=True):
        assert set(a) == set(b) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_param_groups_keep_their_own_hyper_parameters() -> None:
    """Two groups with different weight decay, chunked across the group boundary."""
    a, b = _params(2), _params(2)
    plain = torch.optim.AdamW([{"params": a[:2], "weight_decay": 0.5}, {"params": a[2:]}], lr=0.1)
    host = HostAdamW(
        [{"params": b[:2], "weight_decay": 0.5}, {"params": b[2:]}], lr=0.1, chunk_params=20
    )
    for p, q in zip(a, b, strict=True):
        p.grad = q.grad = torch.ones_like(p)
    plain.step()
    host.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert [len(g["params"]) for g in host.param_groups] == [2, 3]  # restored after the step


# GPU-only: pinned host memory and the host<->device moves exist only with CUDA; on a CPU the
# moments never leave the parameters' device (the tests above cover the stepping).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_moments_rest_in_pinned_host_memory() -> None:
    want, _ = _run(lambda ps: torch.optim.AdamW(ps, **ADAMW), "cuda")
    got, state = _run(lambda ps: HostAdamW(ps, chunk_params=8, **ADAMW), "cuda")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for st in state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].device.type == "cpu" and st[key].is_pinned()
