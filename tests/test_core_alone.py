"""`pip install miles-core` alone is an honest, working install: a brand-new venv with the core's
wheel and only the third parties it declares (transitively; no Ray, no torch, no transformers, no
other miles-* package) imports every core module, and `miles --help` and `miles plugins list`
work; `miles run` and `miles recipes plan` say what to install. With miles-runtime added (still
no torch), `miles recipes plan` sizes a model and `miles run` names the default backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .conftest import make_venv, sh, venv_env

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

# A Llama-shaped checkpoint's config.json: no installed family covers it in a core-only venv.
LLAMA = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory, core_wheel: Path) -> Path:
    return make_venv(tmp_path_factory.mktemp("core") / "venv", core_wheel, only_declared=True)


@pytest.fixture(scope="module")
def runtime_venv(
    tmp_path_factory: pytest.TempPathFactory, core_wheel: Path, runtime_wheel: Path
) -> Path:
    path = tmp_path_factory.mktemp("runtime") / "venv"
    return make_venv(path, core_wheel, runtime_wheel, only_declared=True)


PROBE = (
    "import importlib.util as u\n"
    "names = ['torch', 'transformers', 'miles.torch', 'miles.recipes', 'miles.runtime', 'ray',"
    " 'pluggy']\n"
    "print([n for n in names if u.find_spec(n) is not None])"
)


def test_the_venv_has_no_ray_torch_transformers_or_other_miles(core_venv: Path) -> None:
    assert sh(core_venv / "bin/python", "-c", PROBE).strip() == "['pluggy']"


def test_the_runtime_brings_ray_but_no_torch(runtime_venv: Path) -> None:
    found = sh(runtime_venv / "bin/python", "-c", PROBE).strip()
    assert found == "['miles.runtime', 'ray', 'pluggy']"


def test_old_import_paths_still_work_with_a_warning(core_venv: Path, runtime_venv: Path) -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "from miles.core.contracts.types import Sample\n"
        "try:\n"
        "    from miles.core.types import Sample as Old\n"
        "except DeprecationWarning as w:\n"
        "    print(w)\n"
        "warnings.simplefilter('ignore')\n"
        "from miles.core.types import Sample as Old\n"
        "assert Old is Sample\n"
        "try:\n"
        "    import miles.core.runner\n"
        "    print('runner', miles.core.runner.__name__)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    core = sh(core_venv / "bin/python", "-c", code, env=venv_env()).splitlines()
    assert core[0].startswith("miles.core.types is deprecated: import miles.core.contracts.types")
    assert core[1] == (
        "miles.core.runner moved to miles.runtime.runner, in the miles-runtime distribution: "
        "pip install miles-runtime"
    )
    runtime = sh(runtime_venv / "bin/python", "-c", code, env=venv_env()).splitlines()
    assert runtime[1] == "runner miles.runtime.runner"


def test_every_core_module_imports(core_venv: Path) -> None:
    code = (
        "import importlib, pkgutil, sys, miles.core as core\n"
        "names = [m.name for m in pkgutil.walk_packages(core.__path__, 'miles.core.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print(len(names))"
    )
    assert int(sh(core_venv / "bin/python", "-c", code, env=venv_env())) > 20


def test_help_and_plugins_list(core_venv: Path) -> None:
    assert "Commands:" in sh(core_venv / "bin/miles", "--help", env=venv_env())
    listed = json.loads(sh(core_venv / "bin/miles", "plugins", "list", "--json", env=venv_env()))
    assert [p["name"] for p in listed] == ["miles-core"] and listed[0]["status"] == "ok"


def _config(tmp_path: Path) -> Path:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    config = {
        "model": {"path": str(model)},
        "data": {"path": "prompts.jsonl"},
        "train": {"world_size": 8, "micro_batch_tokens": 8192},
        "rollout": {"engines": 2, "max_new_tokens": 1024},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_runtimes_commands_say_what_to_install(core_venv: Path, tmp_path: Path) -> None:
    import subprocess

    for args, hint in [
        (
            ("run", "quickstart"),
            "`miles run` comes with miles-runtime, which the default backends bring: "
            "pip install miles-torch miles-rollouts miles-rewards miles-losses miles-precision",
        ),
        (
            ("recipes", "plan", "x.yaml"),
            "`miles recipes plan` comes with miles-runtime (the memory planner): "
            "pip install miles-runtime",
        ),
    ]:
        proc = subprocess.run(
            [core_venv / "bin/miles", *args],
            capture_output=True, text=True, cwd=tmp_path, env=venv_env(), timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2 and hint in proc.stderr, proc.stderr


def test_every_runtime_module_imports_without_torch(runtime_venv: Path) -> None:
    code = (
        "import importlib, pkgutil, sys, miles.runtime as rt\n"
        "names = [m.name for m in pkgutil.walk_packages(rt.__path__, 'miles.runtime.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print(len(names))"
    )
    assert int(sh(runtime_venv / "bin/python", "-c", code, env=venv_env())) > 30


def test_recipes_plan_sizes_a_model_with_no_family_and_no_backend(
    runtime_venv: Path, tmp_path: Path
) -> None:
    out = sh(
        runtime_venv / "bin/miles", "recipes", "plan", _config(tmp_path), "--gpu-mem", "80GB",
        "--json", env=venv_env(),
    )  # fmt: skip
    plan = json.loads(out)
    assert plan["fits"] is True and plan["family"] == "(generic dense decoder)"
    # Llama's own count for this config: embeddings, 22 layers, final norm, untied head.
    assert plan["params"]["language_model"] == 1_100_048_384
    notes = " ".join(plan["notes"])
    assert "train backend 'fsdp' is not installed here" in notes
    assert "no installed family covers model_type 'llama'" in notes


def test_run_names_the_packages_of_the_defaults(runtime_venv: Path, tmp_path: Path) -> None:
    import subprocess

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    proc = subprocess.run(
        [runtime_venv / "bin/miles", "run", _config(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=venv_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "rollout: unknown rollout_backend 'torch'" in proc.stderr
    assert (
        "pip install miles-torch miles-rollouts miles-rewards miles-losses miles-precision"
        in proc.stderr
    )


def test_the_generic_estimate_counts_llama_exactly() -> None:
    """What the core planner counts for a model no family covers, against transformers' own
    count of the same config (on the meta device: no weights)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from miles.runtime.planning.generic_shape import generic_decoder_shape

    shape = generic_decoder_shape(LLAMA)
    assert shape is not None
    config = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape.params.total == sum(p.numel() for p in model.parameters())
    assert generic_decoder_shape({**LLAMA, "num_experts": 8}) is None  # not a dense decoder
