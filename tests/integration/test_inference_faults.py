"""The client against a real HTTP server that injects 5xx, 429, slow answers, resets and aborts on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from factory.inference.client import InferenceClient, InferenceConfig, InferenceError, InferenceRequestError
from factory.inference.fault_server import FaultServer
from factory.inference.types import SamplingParams

pytestmark = pytest.mark.integration

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, probe_interval_s=0.05, timeout=2.0)
PROMPT = [1, 2, 3]


@pytest.fixture
def servers() -> Iterator[list[FaultServer]]:
    started = [FaultServer().start(), FaultServer().start()]
    yield started
    for server in started:
        server.stop()


def run(coro):
    return asyncio.run(coro)


def _client(*servers: FaultServer, **overrides) -> InferenceClient:
    return InferenceClient(InferenceConfig(base_url=[s.base_url + "/v1" for s in servers], **{**FAST, **overrides}))


def test_5xx_429_reset_and_slow_answers_are_retried_until_success(servers: list[FaultServer]) -> None:
    server = servers[0]
    server.inject("500", "429", "reset", "slow:3", "503")

    async def go():
        async with _client(server, max_retries=5, timeout=0.5) as client:
            return await client.generate(PROMPT, n=2, sampling=SamplingParams(max_tokens=4))

    completions = run(go())
    assert len(completions) == 2 and all(c.output_token_ids == [10, 11, 12, 13] for c in completions)
    assert server.hits["/generate"] == 6  # five faults, then the answer


def test_bounded_retries_end_in_an_error_naming_the_endpoint_and_failure(servers: list[FaultServer]) -> None:
    server = servers[0]
    server.inject(*["500"] * 10)

    async def go():
        async with _client(server, max_retries=2) as client:
            await client.chat([{"role": "user", "content": "hi"}])

    started = time.monotonic()
    with pytest.raises(InferenceError) as caught:
        run(go())
    assert server.base_url in str(caught.value) and "HTTP 500" in str(caught.value)
    assert server.hits["/v1/chat/completions"] == 3 and time.monotonic() - started < 2


def test_other_4xx_fail_at_once_without_retry(servers: list[FaultServer]) -> None:
    server = servers[0]
    server.inject("400")

    async def go():
        async with _client(server, max_retries=5) as client:
            await client.completion("hi")

    with pytest.raises(InferenceRequestError, match="HTTP 400"):
        run(go())
    assert server.hits["/v1/completions"] == 1


def test_a_failing_endpoint_is_taken_out_and_probed_back_in(servers: list[FaultServer]) -> None:
    good, bad = servers
    bad.down = True

    async def go():
        async with _client(good, bad, eject_after_failures=1) as client:
            first = await asyncio.gather(*(client.generate(PROMPT, n=1) for _ in range(20)))
            assert {c[0].endpoint for c in first} == {good.base_url}
            bad.down = False
            await asyncio.sleep(0.3)  # probe interval 0.05 s
            second = await asyncio.gather(*(client.generate(PROMPT, n=1) for _ in range(20)))
            return {c[0].endpoint for c in second}

    assert run(go()) == {good.base_url, bad.base_url}


def test_least_in_flight_balancing_respects_the_per_endpoint_cap(servers: list[FaultServer]) -> None:
    a, b = servers
    a.inject(*["slow:0.2"] * 4)
    b.inject(*["slow:0.2"] * 4)

    async def go():
        async with _client(a, b, num_max_requests_at_once=2) as client:
            started = time.monotonic()
            await asyncio.gather(*(client.generate(PROMPT) for _ in range(8)))
            return time.monotonic() - started

    elapsed = run(go())
    # 8 requests, 2 endpoints x 2 slots: two waves; each endpoint gets exactly half.
    assert a.hits["/generate"] == b.hits["/generate"] == 4
    assert 0.35 < elapsed < 1.5


def test_n_is_split_and_topped_up_for_servers_that_cap_it() -> None:
    with FaultServer(max_n=1) as server:  # answers one choice whatever n says
        async def go():
            async with _client(server, max_n_per_request=3) as client:
                chat = await client.chat([{"role": "user", "content": "hi"}], n=5)
                gen = await client.generate(PROMPT, n=4)
            async with _client(server, server_type="vllm", n_kwarg_is_ignored=True) as client:
                ignored = await client.generate(PROMPT, n=3)  # /v1/completions with a token prompt, n=1 each
            return chat, gen, ignored

        chat, gen, ignored = run(go())
    assert len(chat) == 5 and len(gen) == 4 and len(ignored) == 3
    assert server.hits["/v1/completions"] == 3 and all(c.output_logprobs == [-0.5] * 4 for c in ignored)


def test_aborted_generations_are_retried_and_rollouts_carry_the_weight_version(servers: list[FaultServer]) -> None:
    server, other = servers

    async def go():
        async with _client(server, other) as client:
            before = await client.generate(PROMPT)
            await client.update_weights_from_disk("/ckpt/step-3", 3)
            server.inject("abort")  # a request aborted by the update is retried
            other.inject("abort")
            after = await client.generate(PROMPT)
            return before, after, client.policy_version

    before, after, version = run(go())
    assert server.weight_version == other.weight_version == 3  # every endpoint was updated
    assert before[0].policy_version == 0 and after[0].policy_version == 3 and version == 3
    assert after[0].finish_reason != "abort"
    assert len(server.faults) + len(other.faults) < 2  # at least one abort was answered, then retried
