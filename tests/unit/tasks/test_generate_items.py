"""generate_items: every item's group in item order, at most max_in_flight items sampled at once, a failed item an
error rollout of its own, an outage (EndpointsDown) the chunk's failure."""

from __future__ import annotations

import asyncio

import pytest

from environments.base import BaseEnv, Item
from factory.inference.health import EndpointsDown
from factory.inference.types import Completion, SamplingParams
from tasks.generate import generate_items


class _Env(BaseEnv):
    name = "items"

    def get_item(self, index):
        return Item(str(index), [{"role": "user", "content": f"q{index}"}])

    def score(self, item, completion):
        return 0.0


class _Sampler:
    """Answers later items sooner (so completion order differs from item order) and counts calls in flight."""

    def __init__(self, fail: set[str] = frozenset(), down: str | None = None) -> None:
        self.fail, self.down = fail, down
        self.in_flight = self.most_in_flight = 0

    async def complete(self, messages, *, n, sampling: SamplingParams, prompt_ids=None):
        key = messages[0]["content"][1:]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001 * (10 - int(key) % 10))
            if key == self.down:
                raise EndpointsDown("every endpoint is down")
            if key in self.fail:
                raise ValueError(f"bad answer for {key}")
            return [Completion(f"a{key}", [1], [2], None, "stop", 0, "e") for _ in range(n)]
        finally:
            self.in_flight -= 1


def test_groups_come_back_in_item_order_with_at_most_max_in_flight_sampled_at_once():
    env, sampler = _Env(), _Sampler()
    items = [env.get_item(i) for i in range(25)]
    chunk = asyncio.run(generate_items(env, items, sampler, max_in_flight=4))
    assert [group[0].text for group in chunk.rollouts] == [f"a{i}" for i in range(25)]
    assert sampler.most_in_flight == 4 and chunk.failed_items == 0 and chunk.items == items


def test_a_failed_item_is_an_error_rollout_of_its_own_and_the_others_are_kept():
    env, sampler = _Env(), _Sampler(fail={"3", "7"})
    chunk = asyncio.run(generate_items(env, [env.get_item(i) for i in range(10)], sampler, max_in_flight=3))
    assert chunk.failed_items == 2
    errors = {i: group[0].error for i, group in enumerate(chunk.rollouts) if group[0].error}
    assert set(errors) == {3, 7} and errors[3] == "generate_error: ValueError: bad answer for 3"
    assert all(group[0].text == f"a{i}" for i, group in enumerate(chunk.rollouts) if i not in errors)


def test_every_endpoint_down_fails_the_chunk():
    env, sampler = _Env(), _Sampler(down="5")
    with pytest.raises(EndpointsDown):
        asyncio.run(generate_items(env, [env.get_item(i) for i in range(10)], sampler, max_in_flight=3))


def test_no_items_is_an_empty_chunk():
    chunk = asyncio.run(generate_items(_Env(), [], _Sampler(), max_in_flight=4))
    assert chunk.rollouts == [] and chunk.failed_items == 0
