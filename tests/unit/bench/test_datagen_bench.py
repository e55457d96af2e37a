"""The datagen bench's instant server and raw client talk to each other and count every choice."""

from __future__ import annotations

import asyncio

from bench.datagen import instant_server, raw_client


def test_instant_server_answers_n_tagged_choices_near_the_sum():
    answer = instant_server.chat_response({"n": 3, "messages": [{"role": "user", "content": "Compute 10+20."}]})
    assert len(answer["choices"]) == 3
    for choice in answer["choices"]:
        assert choice["message"]["content"] in {f"<answer>{n}</answer>" for n in (29, 30, 31)}


def test_raw_socket_client_counts_every_choice_of_every_call():
    async def scenario() -> dict:
        server = await asyncio.start_server(instant_server.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await raw_client.run_one(f"http://127.0.0.1:{port}/v1", "sockets", groups=50, group_size=4,
                                            concurrency=8)

    result = asyncio.run(scenario())
    assert result["groups"] == 50 and result["choices"] == 200
    assert result["ended"] >= result["started"]


def test_raw_httpx_client_counts_every_choice_of_every_call():
    async def scenario() -> dict:
        server = await asyncio.start_server(instant_server.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await raw_client.run_one(f"http://127.0.0.1:{port}/v1", "httpx", groups=20, group_size=2,
                                            concurrency=4)

    assert asyncio.run(scenario())["choices"] == 40
