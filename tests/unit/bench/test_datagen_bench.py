"""The datagen bench's instant server and raw client talk to each other and count every choice."""

from __future__ import annotations

import asyncio
import json

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


def test_the_raw_limit_is_the_fastest_client_in_one_process():
    """The flow is one worker process: a faster 2-process client row is printed but is not the limit it is held to."""
    from bench.datagen.run import fastest_one_process

    rows = [{"kind": "sockets", "procs": 1, "server_workers": 1, "groups_per_s": 2300.0},
            {"kind": "sockets", "procs": 2, "server_workers": 2, "groups_per_s": 2650.0},
            {"kind": "aiohttp", "procs": 1, "server_workers": 2, "groups_per_s": 1100.0}]
    assert fastest_one_process(rows) == rows[0]


def test_the_per_round_table_gives_the_flow_to_raw_and_to_atropos_ratios(capsys):
    from bench import harness
    from bench.datagen.run import INLINE, print_rounds

    result = harness.Comparison("datagen", "raw", ["raw", INLINE, "atroposlib 0.4.0 process mode"], values={
        "raw": {"groups/s": [2000.0, 1000.0]},
        INLINE: {"groups/s": [500.0, 200.0], "groups/s, pipeline only": [600.0, 300.0]},
        "atroposlib 0.4.0 process mode": {"groups/s, pipeline only": [40.0, 30.0],
                                          "groups/s, whole process (report excluded)": [25.0, 20.0]}})
    print_rounds(result)
    out = capsys.readouterr().out
    assert "0.250x" in out and "0.200x" in out  # whole call / raw, per round
    assert "0.300x" in out and "15.00x" in out and "10.00x" in out  # pipeline / raw, pipeline / Atropos
    assert "20.00x" in out  # whole call / Atropos whole process
    assert "server ids" not in out


def test_the_per_round_table_shows_the_flow_with_and_without_server_ids(capsys):
    from bench import harness
    from bench.datagen.run import INLINE, INLINE_IDS, RAW_IDS, print_rounds

    result = harness.Comparison("datagen", "raw", ["raw", RAW_IDS, INLINE, INLINE_IDS], values={
        "raw": {"groups/s": [2000.0]},
        RAW_IDS: {"groups/s": [1500.0]},
        INLINE: {"groups/s": [500.0], "groups/s, pipeline only": [600.0]},
        INLINE_IDS: {"groups/s": [700.0], "groups/s, pipeline only": [900.0]}})
    print_rounds(result)
    out = capsys.readouterr().out
    assert "| no ids |" in out and "| server ids |" in out
    assert "0.300x" in out and "0.450x" in out  # each side's pipeline / the same (no-ids) raw limit
    assert "| 1500 | 0.600x |" in out  # the ids flow's pipeline / the raw loop asking for ids too (same calls)
    assert "| 2000 | 0.300x |" in out  # the no-ids flow's own calls are the baseline's


def test_instant_server_returns_token_ids_only_when_asked():
    answer = instant_server.chat_response({"n": 2, "messages": [{"role": "user", "content": "Compute 1+2."}],
                                           "return_token_ids": True})
    assert "prompt_token_ids" not in answer  # a server started without a tokenizer has none to give


def test_instant_server_token_ids_are_the_ids_the_worker_computes_itself(tmp_path, monkeypatch):
    """The ids the server returns (vLLM's shape) are what ClientSampler makes from the text, so a flow that asks for
    them writes the same rows as one that tokenizes locally."""
    from factory.inference.endpoints import Endpoint
    from factory.inference.parse import parse_chat
    from factory.inference.tiny_model import make_tiny_policy
    from tasks.generate import ClientSampler, load_tokenizer

    policy = make_tiny_policy(tmp_path / "policy")
    monkeypatch.setattr(instant_server, "TOKEN_IDS", instant_server.TokenIds(str(policy)))
    messages = [{"role": "user", "content": "Compute 12+30. Put the answer in <answer></answer>."}]
    body = {"n": 4, "messages": messages}
    with_ids = instant_server.chat_response({**body, "return_token_ids": True})
    assert "prompt_token_ids" not in instant_server.chat_response(body)
    assert all(choice["token_ids"] for choice in with_ids["choices"]) and with_ids["prompt_token_ids"]
    ep = Endpoint("http://x/v1")
    sampler = ClientSampler(None, load_tokenizer(str(policy)), "chat")
    local = sampler._tokenize_all(messages, parse_chat(instant_server.chat_response(body), ep))
    served = sampler._tokenize_all(messages, parse_chat(with_ids, ep))
    assert [(c.prompt_token_ids, c.output_token_ids) for c in served] == \
        [(c.prompt_token_ids, c.output_token_ids) for c in local]


def test_instant_server_generate_gives_the_chat_answers_and_ids(tmp_path, monkeypatch):
    """SGLang's /generate on the prompt's ids (as the flow templates them) gets the answers and ids the chat call
    gets, so the /generate flow writes the same rows as the chat sides."""
    from factory.inference.endpoints import Endpoint
    from factory.inference.parse import parse_chat, parse_generate
    from factory.inference.tiny_model import make_tiny_policy
    from tasks.generate import load_tokenizer, prompt_ids

    policy = make_tiny_policy(tmp_path / "policy")
    monkeypatch.setattr(instant_server, "TOKEN_IDS", instant_server.TokenIds(str(policy)))
    messages = [{"role": "user", "content": "Compute 12+30. Put the answer in <answer></answer>."}]
    ids = prompt_ids(load_tokenizer(str(policy)), messages)
    ep = Endpoint("http://x")
    chat = parse_chat(instant_server.chat_response({"n": 4, "messages": messages, "return_token_ids": True}), ep)
    generated = parse_generate(instant_server.generate_response(
        {"input_ids": ids, "sampling_params": {"n": 4}, "return_logprob": True}), ids, ep)
    assert [(c.text, c.prompt_token_ids, c.output_token_ids, c.finish_reason) for c in generated] == \
        [(c.text, c.prompt_token_ids, c.output_token_ids, c.finish_reason) for c in chat]
    assert instant_server.generate_response({"input_ids": ids, "sampling_params": {"n": 1}})["text"] == chat[0].text


def test_the_per_round_table_has_no_same_calls_ratio_for_generate(capsys):
    from bench import harness
    from bench.datagen.run import INLINE, INLINE_GENERATE, INLINE_IDS, RAW_IDS, print_rounds

    result = harness.Comparison("datagen", "raw", ["raw", RAW_IDS, INLINE, INLINE_IDS, INLINE_GENERATE], values={
        "raw": {"groups/s": [2000.0]},
        RAW_IDS: {"groups/s": [1500.0]},
        INLINE: {"groups/s": [500.0], "groups/s, pipeline only": [600.0]},
        INLINE_IDS: {"groups/s": [700.0], "groups/s, pipeline only": [900.0]},
        INLINE_GENERATE: {"groups/s": [400.0], "groups/s, pipeline only": [560.0]}})
    print_rounds(result)
    out = capsys.readouterr().out
    assert "| /generate (ids both ways) | 2000 | 400 | 0.200x | 560 | 0.280x | - | - |" in out


def test_raw_client_asks_for_token_ids_with_the_flag(monkeypatch):
    assert "return_token_ids" not in json.loads(raw_client.body(3, 8))
    monkeypatch.setitem(raw_client.EXTRA, "return_token_ids", True)
    assert json.loads(raw_client.body(3, 8))["return_token_ids"] is True


def test_instant_server_answers_a_repeated_request_from_its_cache_with_the_same_bytes(monkeypatch):
    monkeypatch.setattr(instant_server, "_answers", {})
    body = json.dumps({"n": 2, "messages": [{"role": "user", "content": "Compute 3+4."}]}).encode()
    first = instant_server.encoded_answer("POST", "/v1/chat/completions", body)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b'"<answer>7</answer>"' in first

    async def ask_twice() -> list[bytes]:
        server = await asyncio.start_server(instant_server.handle, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        answers = []
        for _ in range(2):
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            answers.append(head + await reader.readexactly(length))
        writer.close()
        server.close()
        return answers

    assert asyncio.run(ask_twice()) == [first, first]
    assert list(instant_server._answers) == [("POST /v1/chat/completions", body)]
