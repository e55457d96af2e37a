"""CPU per chat call of each HTTP client option for the inference client, on the instant server (issue 33).

Each option makes the same chat calls (n choices each, `--concurrency` in flight) and parses the answer to a
dict; what is compared is this process's CPU seconds per call (the server runs in its own process), in
interleaved rounds (A, B, C, A, B, C, ...) because the machine is shared. Options:

- `httpx`: factory.inference.http_pool.ShardedHttp (httpx AsyncClients of 8 connections), response.json();
- `aiohttp`: one aiohttp ClientSession (TCPConnector limit=concurrency), orjson on the body;
- `streams`: factory.inference.http_pool.KeepAliveHttp (asyncio streams, orjson);
- `streams-uvloop`: the same on uvloop's event loop;
- `client`: the whole InferenceClient.chat path (endpoint pool, retries, parse_chat) over KeepAliveHttp.

    python -m bench.datagen.http_clients --calls 2000 --rounds 3
    python -m bench.datagen.http_clients --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import orjson

from bench.datagen.run import InstantServer
from factory.inference.http_pool import KeepAliveHttp, ShardedHttp

OPTIONS = ("httpx", "aiohttp", "streams", "streams-uvloop", "client-httpx", "client")


def body(index: int, group_size: int) -> dict:
    prompt = f"Compute {10 + index % 90}+{20 + index % 70}. Put the answer in <answer></answer>."
    return {"model": "m", "n": group_size, "max_tokens": 16, "messages": [{"role": "user", "content": prompt}]}


async def drive(calls: int, concurrency: int, call) -> int:
    indices = iter(range(calls))
    choices = 0

    async def work() -> None:
        nonlocal choices
        for index in indices:
            got = await call(index)
            choices += got

    await asyncio.gather(*(work() for _ in range(concurrency)))
    return choices


async def run_option(option: str, base_url: str, calls: int, concurrency: int, group_size: int) -> int:
    url = base_url + "/chat/completions"
    timeout = httpx.Timeout(120.0, connect=10.0)
    if option == "httpx":
        http = ShardedHttp(concurrency, timeout=timeout, headers={"Authorization": "Bearer x"})

        async def call(i: int) -> int:
            return len((await http.post(url, json=body(i, group_size))).json()["choices"])
    elif option == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                        headers={"Authorization": "Bearer x"})

        async def call(i: int) -> int:
            async with session.post(url, data=orjson.dumps(body(i, group_size)),
                                    headers={"Content-Type": "application/json"}) as response:
                return len(orjson.loads(await response.read())["choices"])

        http = session
        http.aclose = session.close  # type: ignore[attr-defined]
    elif option.startswith("streams"):
        http = KeepAliveHttp(timeout=timeout, headers={"Authorization": "Bearer x"})

        async def call(i: int) -> int:
            return len((await http.post(url, json=body(i, group_size))).json()["choices"])
    else:
        from factory.inference.client import InferenceClient, InferenceConfig
        from factory.inference.types import SamplingParams

        client = InferenceClient(InferenceConfig(base_url=base_url, server_type="openai",
                                                 num_max_requests_at_once=concurrency))
        if option == "client-httpx":
            await client._http.aclose()
            client._http = client.pool._http = ShardedHttp(concurrency, timeout=timeout,
                                                          headers={"Authorization": "Bearer x"})
        await client.__aenter__()
        sampling = SamplingParams(max_tokens=16)

        async def call(i: int) -> int:
            messages = body(i, group_size)["messages"]
            return len(await client.chat(messages, n=group_size, sampling=sampling))

        http = client
    try:
        await drive(min(64, calls), concurrency, call)  # warm: connections open, code paths hot
        started = time.process_time()
        choices = await drive(calls, concurrency, call)
        cpu = time.process_time() - started
    finally:
        await http.aclose()
    assert choices == calls * group_size, (option, choices)
    return cpu


def measure(option: str, base_url: str, args: argparse.Namespace) -> dict:
    coroutine = run_option(option, base_url, args.calls, args.concurrency, args.group_size)
    wall = time.perf_counter()
    if option.endswith("uvloop"):
        import uvloop

        cpu = uvloop.run(coroutine)
    else:
        cpu = asyncio.run(coroutine)
    wall = time.perf_counter() - wall
    return {"option": option, "cpu_us_per_call": round(cpu / args.calls * 1e6, 1), "wall_s": round(wall, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.rounds = 100, 1
    options = args.options.split(",")
    rows: dict[str, list[float]] = {option: [] for option in options}
    with InstantServer(1) as server:
        for round_index in range(args.rounds):
            for option in options:
                row = measure(option, server.base_url, args)
                rows[option].append(row["cpu_us_per_call"])
                print(json.dumps({"round": round_index, **row}), flush=True)
    base = statistics.median(rows[options[0]])
    print(f"\n| option | CPU us/call (median of {args.rounds}) | vs {options[0]} |\n|---|---:|---:|")
    for option in options:
        median = statistics.median(rows[option])
        print(f"| {option} | {median:.0f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
