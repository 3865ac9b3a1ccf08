from miles.core.contracts.types import Sample, SampleStatus
from miles.rewards.filters import DynamicSampling, DynamicSamplingConfig, Length, LengthConfig


def _group(rewards: list[float]) -> list[Sample]:
    return [
        Sample(prompt_ids=[1], response_ids=[2] * (i + 1), reward=r) for i, r in enumerate(rewards)
    ]


def test_dynamic_sampling_drops_groups_without_signal() -> None:
    f = DynamicSampling(DynamicSamplingConfig(max_rounds=2))
    assert f(_group([1.0, 1.0, 1.0])) == []
    assert f(_group([0.0, 0.0])) == []
    mixed = _group([1.0, 0.0, 1.0])
    assert f(mixed) == mixed
    assert f.oversample_rounds == 2


def test_length_filter() -> None:
    group = _group([0.0] * 4)  # response lengths 1..4
    group[3].status = SampleStatus.TRUNCATED
    kept = Length(LengthConfig(min_tokens=2, max_tokens=4, drop_truncated=True))(group)
    assert [len(s.response_ids) for s in kept] == [2, 3]
