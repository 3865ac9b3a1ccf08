"""A train call under torch.profiler (`telemetry.profile_steps`), written for reading later."""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


@contextmanager
def profiled(path: str, device: torch.device) -> Iterator[None]:
    """torch.profiler over what runs inside: `path`.txt (the top operators by host and by device
    time) and `path`.json.gz (a Chrome trace, for Perfetto or chrome://tracing)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    keys = ("self_cpu_time_total", "self_device_time_total" if cuda else "cpu_time_total")
    tables = [f"sorted by {k}:\n" + averages.table(sort_by=k, row_limit=40) for k in keys]
    Path(f"{path}.txt").write_text("\n\n".join(tables))
    trace = Path(f"{path}.json")
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
