import torch

from miles.precision.dtype import bf16, fp32


def test_bf16_converts_model_and_rollout_weights_alike() -> None:
    model = torch.nn.Linear(4, 4)
    precision = bf16()
    assert precision.convert_model(model).weight.dtype == torch.bfloat16
    named = [("w", torch.ones(2)), ("step", torch.tensor([3]))]
    out = dict(precision.convert_for_rollout(named))
    assert out["w"].dtype == torch.bfloat16 and out["step"].dtype == torch.int64


def test_fp32_is_identity_on_fp32() -> None:
    t = torch.randn(3)
    assert torch.equal(dict(fp32().convert_for_rollout([("t", t)]))["t"], t)
