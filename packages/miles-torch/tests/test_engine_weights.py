"""load_weights, weights_checksum and the shared `tensors_checksum`."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.sync.checksum import tensors_checksum

torch.set_num_threads(1)

REQUESTS = [
    GenerateRequest(i, p, SamplingParams(temperature=0.0, max_new_tokens=8))
    for i, p in enumerate([[5, 6, 7], [40, 41, 42, 43, 44], [9]])
]


def outputs(engine):
    return sorted(
        (r.request_id, r.response_ids, r.logprobs, r.weight_version)
        for r in engine.results(REQUESTS)
    )


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_load_weights_syncs_checksum_and_outputs(tiny_model, arch):
    engine = TorchRolloutEngine(tiny_model(arch, seed=0))
    other = TorchRolloutEngine(tiny_model(arch, seed=1))
    assert engine.weights_checksum() != other.weights_checksum()
    before = outputs(engine)

    trainer_side = AutoModelForCausalLM.from_pretrained(tiny_model(arch, seed=1))
    engine.load_weights(trainer_side.state_dict().items(), version=3)

    assert engine.weight_version == 3 and engine.health()["weight_version"] == 3
    assert engine.weights_checksum() == other.weights_checksum()
    assert engine.weights_checksum() == tensors_checksum(trainer_side.state_dict().items())
    after = outputs(engine)
    assert [o[3] for o in after] == [3, 3, 3]
    assert [o[1:3] for o in after] != [o[1:3] for o in before]
    assert [o[1:3] for o in after] == [o[1:3] for o in outputs(other)]


def test_load_weights_takes_a_subset_and_casts_dtype(tiny_model):
    engine = TorchRolloutEngine(tiny_model("qwen3"))
    new = torch.full_like(engine.model.lm_head.weight, 0.5, dtype=torch.bfloat16)
    engine.load_weights([("lm_head.weight", new)], version=1)
    assert engine.model.lm_head.weight.dtype == torch.float32
    assert torch.equal(engine.model.lm_head.weight, new.float())


def test_load_weights_rejects_bad_names_and_shapes(tiny_model):
    engine = TorchRolloutEngine(tiny_model("qwen3"))
    checksum = engine.weights_checksum()
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.not_a_layer\.weight'"):
        engine.load_weights([("model.not_a_layer.weight", torch.zeros(2))], version=5)
    with pytest.raises(ValueError, match=r"'lm_head\.weight' has shape \(3, 2\)"):
        engine.load_weights([("lm_head.weight", torch.zeros(3, 2))], version=5)
    assert engine.weight_version == 0
    assert engine.weights_checksum() == checksum


def test_tensors_checksum_properties():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    base = tensors_checksum([("a", a), ("b", b)])
    assert base == tensors_checksum([("b", b.clone()), ("a", a.clone())])  # order-free
    assert base == tensors_checksum([("a", a.t().contiguous().t()), ("b", b)])  # layout-free
    assert base != tensors_checksum([("a", a.double()), ("b", b)])  # dtype counts
    assert base != tensors_checksum([("a", a.reshape(3, 2)), ("b", b)])  # shape counts
    assert base != tensors_checksum([("a2", a), ("b", b)])  # names count
    changed = a.clone()
    changed[1, 2] += 1
    assert base != tensors_checksum([("a", changed), ("b", b)])
    assert len(base) == 64 and tensors_checksum([]) != base
    with pytest.raises(ValueError, match="twice"):
        tensors_checksum([("a", a), ("a", a)])


@pytest.mark.gpu
def test_tensors_checksum_is_device_independent():
    named = [
        ("w", torch.randn(5, 7)),
        ("h", torch.randn(3).to(torch.bfloat16)),
        # Hashed on the device (1 MiB and more), one of several chunks, an odd byte count.
        ("big", torch.randn(4099, 1031).to(torch.bfloat16)),
        ("chunks", torch.randint(-(2**31), 2**31 - 1, (3 * 2**24 + 5,), dtype=torch.int32)),
    ]
    on_gpu = [(n, t.cuda()) for n, t in named]
    assert tensors_checksum(named) == tensors_checksum(on_gpu)
