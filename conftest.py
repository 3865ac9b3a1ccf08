"""Suite-wide pytest set-up: GPU tests skip themselves where no CUDA device is visible, and the
`plant` fixture fakes an installed plugin distribution."""

import contextlib
import itertools
import os
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.core.registry import plugins

# Tests never reach a model hub: every model is made at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """The token of Ray's token authentication (on for every local Ray `miles run` starts) is
    made once here, before test workers start runs at the same time: Ray makes it on first use,
    and two first uses at once would write two different tokens."""
    token = Path.home() / ".ray" / "auth_token"
    if not token.exists():
        token.parent.mkdir(parents=True, exist_ok=True)
        tmp = token.with_name(f".auth_token.{os.getpid()}")
        tmp.write_text(uuid.uuid4().hex)
        tmp.chmod(0o600)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, token)  # never replaces a token another process made meanwhile
        tmp.unlink()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The test files that take longest (seconds of test time on the 2-core CI machine, most of it
# miles runs), started first: with two workers, the file that starts last sets the suite's
# tail. tools/test.sh keeps this order (`--no-loadscope-reorder`: xdist would otherwise start
# files with many tests first, which are the quick ones).
LONGEST_FIRST = (  # worker-seconds in a full run (2026-12-07, fc4: 2 workers, 4,060 in all)
    "tests/test_modes_and_faults.py",  # ~790
    "packages/miles-sglang/tests/test_sglang_backend.py",  # ~470
    "tests/test_cluster.py",  # ~440
    "packages/miles-agents/tests/test_agent.py",  # ~370, one test
    "tests/test_precisions.py",  # ~310
    "tests/test_chaos.py",  # ~210, one test
    "tests/test_algorithm_runs.py",  # ~120
    "tests/test_moe_replay.py",  # ~90
    "tests/test_recipes_cli.py",  # ~80
    "tests/test_megatron_run.py",  # ~80
    "tests/test_reward_handling_runs.py",  # ~80
    "tests/test_rl_loop.py",  # ~80
    "tests/test_docs.py",  # ~70
    "packages/miles-torch/tests/test_fsdp.py",  # ~60
    "packages/miles-megatron/tests/test_megatron_cpu.py",  # ~60
    "tests/test_smollm2.py",  # ~60
    "tests/test_observed_run.py",  # ~50
    "tests/test_console.py",  # ~50
    "packages/miles-serve/tests/test_serve.py",  # ~50
    "tests/test_bad_data.py",  # ~50
)


def _longest_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: everything else keeps its collection order
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


_counter = itertools.count()
PlantFn = Callable[..., str]


@pytest.fixture
def plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PlantFn:
    """Writes a module plus a ``.dist-info`` whose entry point puts it in the ``miles`` group.

    Returns the module's (unique) name. This is exactly what pip leaves on disk for a plugin.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    # The process-wide plugin manager loads again on next use, seeing the planted plugins.
    monkeypatch.setattr(plugins, "_manager", None)
    monkeypatch.delenv("MILES_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("MILES_DISABLE_PLUGINS", raising=False)

    def _plant(
        dist: str, source: str, *, version: str = "1.0.0", core_range: str | None = ">=0.1,<0.2"
    ) -> str:
        module = f"planted_{dist.replace('-', '_')}_{next(_counter)}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        if core_range is not None:
            meta += f"Requires-Dist: miles-core{core_range}\n"
        (info / "METADATA").write_text(meta)
        (info / "entry_points.txt").write_text(f"[miles]\nmain = {module}\n")
        return module

    return _plant
