"""Config and sampling-parameter validation, and the sampler's pure functions (no model)."""

from __future__ import annotations

import pytest
import torch

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.embedded import EngineConfig, SamplingParams
from mooncake_k8s.engine.embedded.sampling import position_seed, sample_batch, sample_one


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": True}, "max_tokens must be an integer >= 1"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": "hot"}, "temperature must be a finite number >= 0"),
        ({"stop": "END"}, "stop must be a tuple of strings"),
        ({"stop": ("",)}, "stop strings must be non-empty strings"),
        ({"stop": (3,)}, "stop strings must be non-empty strings"),
        ({"stop": ("x" * 300,)}, "at most 256 characters"),
        ({"stop": tuple("abcdefghijklmnopq")}, "at most 16 stop strings"),
        ({"seed": 1.5}, "seed must be an integer or None"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.seed) == (1.0, 1.0, 16, (), None)
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"block_tokens": 0}, "block_tokens must be >= 1"),
        ({"max_batch": 0}, "max_batch must be >= 1"),
        ({"kv_capacity_tokens": 0}, "kv_capacity_tokens must be >= 1"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"prefill_chunk_tokens": 100}, "multiple of block_tokens"),
        ({"model": ""}, "model must be a directory path or None"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_position_seed_depends_on_seed_and_position_only() -> None:
    assert position_seed(7, 100) == position_seed(7, 100)
    assert len({position_seed(7, p) for p in range(100)}) == 100
    assert position_seed(7, 100) != position_seed(8, 100)
    assert 0 <= position_seed(2**62, 10**6) < 2**63


def test_sampling_draws_are_reproducible_and_follow_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    draws = [sample_one(logits, params, 3, pos) for pos in range(400)]
    assert draws == [sample_one(logits, params, 3, pos) for pos in range(400)]
    assert set(draws) == {0, 1}, "top_p=0.7 keeps the two tokens that reach 0.8"
    share = draws.count(0) / len(draws)
    assert 0.5 < share < 0.75, share  # 0.5/0.8 = 0.625 after renormalising
    full = [sample_one(logits, SamplingParams(seed=3), 3, pos) for pos in range(400)]
    assert set(full) == {0, 1, 2, 3}


def test_sample_batch_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=0.5, seed=1)
    got = sample_batch(logits, [greedy, sampled, greedy], [0, 1, 0], [5, 5, 5])
    assert got[0] == 1 and got[2] == 2
    assert got[1] == sample_one(logits[1], sampled, 1, 5)
