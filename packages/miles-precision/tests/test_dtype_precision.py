import torch

from miles.core.contracts.components import Capability, Kind
from miles.core.registry.plugins import get_plugin_manager
from miles.precision.dtype import bf16, fp32


def test_bf16_converts_rollout_weights_and_leaves_training_to_the_backend() -> None:
    model = torch.nn.Linear(4, 4)
    precision = bf16()
    assert precision.convert_model(model) == 0 and model.weight.dtype == torch.float32
    assert (
        precision.rollout_dtype == "bfloat16" and precision.rollout_decoder(torch.bfloat16) is None
    )
    named = [("w", torch.ones(2)), ("step", torch.tensor([3]))]
    out = dict(precision.convert_for_rollout(named))
    assert out["w"].dtype == torch.bfloat16 and out["step"].dtype == torch.int64


def test_fp32_is_identity_on_fp32() -> None:
    t = torch.randn(3)
    assert torch.equal(dict(fp32().convert_for_rollout([("t", t)]))["t"], t)


def test_specs_declare_format_and_memory() -> None:
    manager = get_plugin_manager()
    for name, quantized, weight_bytes in [
        ("fp32", False, 4),
        ("bf16", False, 2),
        ("fp8", True, 1 + 4 / 128**2),
        ("int4-qat", True, 0.5 + 2 / 128),
    ]:
        spec = manager.get(Kind.PRECISION, name).spec
        assert spec.has(Capability.QUANTIZED) == quantized
        config = spec.config() if spec.config is not None else None
        assert spec.memory(config).rollout_weights == weight_bytes
