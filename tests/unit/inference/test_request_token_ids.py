"""Chat and text-completion requests ask for token ids (vLLM's `return_token_ids`) where the server is known to take
the field, so completions the server already tokenized are not encoded again in the worker (issue 33)."""

from __future__ import annotations

import asyncio

import pytest

from factory.inference.client import InferenceClient, InferenceConfig


def _bodies(config: InferenceConfig) -> dict[str, dict]:
    client = InferenceClient(config)  # not entered: _request is replaced, nothing is sent
    sent: dict[str, dict] = {}

    async def request(path, body, parse):
        sent[path] = body
        return []

    client._request = request

    async def run() -> None:
        for call in (client.chat([{"role": "user", "content": "hi"}], n=2), client.completion("hi", n=2)):
            with pytest.raises(Exception):  # no choices come back: the top-up gives up
                await call

    asyncio.run(run())
    return sent


@pytest.mark.parametrize(("config", "asks"), [
    (InferenceConfig(server_type="vllm"), True),
    (InferenceConfig(server_type="openai"), False),
    (InferenceConfig(server_type="sglang"), False),
    (InferenceConfig(server_type="openai", request_token_ids=True), True),
    (InferenceConfig(server_type="vllm", request_token_ids=False), False),
])
def test_token_ids_are_asked_for_where_the_server_takes_the_field(config, asks):
    bodies = _bodies(config)
    assert set(bodies) == {"/v1/chat/completions", "/v1/completions"}
    for body in bodies.values():
        assert body.get("return_token_ids", False) is asks


def test_returned_ids_are_parsed_as_vllm_returns_them():
    from factory.inference.endpoints import Endpoint
    from factory.inference.parse import parse_chat

    data = {"prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop", "token_ids": [7, 0]},
        {"index": 1, "message": {"role": "assistant", "content": "b"}, "finish_reason": "length", "token_ids": [8]}]}
    got = parse_chat(data, Endpoint("http://x"))
    assert [(c.prompt_token_ids, c.output_token_ids, c.finish_reason) for c in got] == [
        ([1, 2, 3], [7, 0], "stop"), ([1, 2, 3], [8], "length")]
