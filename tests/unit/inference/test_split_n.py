"""`InferenceClient._split_n`: one request is awaited in the caller's task (issue 33: no gather task per call); larger
n is still split into reseeded requests and topped up when a server returns fewer."""

from __future__ import annotations

import asyncio

import pytest

from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.types import Completion, SamplingParams


def _completions(k: int, seed: int | None) -> list[Completion]:
    return [Completion(f"{seed}:{i}", None, None, None, "stop", 0, "e") for i in range(k)]


def _split(config: InferenceConfig, n: int, sampling: SamplingParams, *, short_by: int = 0):
    client = InferenceClient(config)  # not entered: _split_n sends nothing itself
    calls: list[tuple[int, int | None, bool]] = []

    async def run():
        caller = asyncio.current_task()

        async def one(k: int, s: SamplingParams) -> list[Completion]:
            calls.append((k, s.seed, asyncio.current_task() is caller))
            return _completions(max(k - short_by, 1) if len(calls) == 1 else k, s.seed)

        return await client._split_n(n, sampling, one)

    return asyncio.run(run()), calls


def test_one_request_runs_in_the_callers_task():
    results, calls = _split(InferenceConfig(), 8, SamplingParams(seed=7))
    assert calls == [(8, 7, True)]
    assert [c.text for c in results] == [f"7:{i}" for i in range(8)]


@pytest.mark.parametrize("config", [InferenceConfig(max_n_per_request=3), InferenceConfig(n_kwarg_is_ignored=True)])
def test_larger_n_is_split_into_reseeded_requests(config):
    results, calls = _split(config, 8, SamplingParams(seed=100))
    cap = config.max_n_per_request or 1
    assert [(k, seed) for k, seed, _ in calls] == [(min(cap, 8 - off), 100 + off) for off in range(0, 8, cap)]
    assert len(results) == 8


def test_a_server_that_returns_fewer_is_topped_up():
    results, calls = _split(InferenceConfig(), 8, SamplingParams(seed=1), short_by=3)
    assert [(k, seed) for k, seed, _ in calls] == [(8, 1), (3, 6)]
    assert len(results) == 8


def test_n_below_one_is_refused():
    with pytest.raises(ValueError, match="n=0"):
        _split(InferenceConfig(), 0, SamplingParams())
