"""The raw limit: the plainest fast client for the datagen bench's calls (one chat call with n choices per group).

Three ways to make the same calls, each with `--concurrency` keep-alive
connections worked by one coroutine each (no semaphore, no SDK, the JSON
answer parsed and its choices counted), in `--procs` processes that start
together and split the groups between them:

- `sockets`: HTTP/1.1 written and read by hand on asyncio streams (stdlib only);
- `aiohttp`: one ClientSession, TCPConnector(limit=concurrency) (needs aiohttp:
  the Atropos venv has it, the factory's environment does not);
- `httpx`: one AsyncClient per 8 connections (one big httpx pool degrades with
  many requests in flight, see bench/RESULTS.md "Client overhead").

`--return-token-ids` asks for the token ids as vLLM's chat API takes it (the
answer is then larger: prompt and choice ids are parsed too).

Stdlib-only at import so any interpreter can run it; prints one JSON line:

    python bench/datagen/raw_client.py --url http://127.0.0.1:31500/v1 --groups 2000 --kind sockets --procs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from urllib.parse import urlsplit


EXTRA: dict = {}
"""Fields added to every request body (`{"return_token_ids": True}` with --return-token-ids)."""


def body(index: int, group_size: int) -> bytes:
    prompt = f"Compute {10 + index % 90}+{20 + index % 70}. Put the answer in <answer></answer>."
    return json.dumps({"model": "m", "n": group_size, "max_tokens": 16,
                       "messages": [{"role": "user", "content": prompt}], **EXTRA}).encode()


async def _workers(connections: list, count: int, call) -> int:
    """One coroutine per connection; together they make `count` calls; returns the choices received."""
    next_index = iter(range(count))
    received = 0

    async def work(connection) -> None:
        nonlocal received
        for index in next_index:
            choices = await call(connection, index)  # not `received += await ...`: that reads before awaiting
            received += choices

    await asyncio.gather(*(work(connection) for connection in connections))
    return received


class Sockets:
    def __init__(self, url: str, group_size: int) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path.rstrip("/") + "/chat/completions"
        self.group_size = group_size

    async def open(self):
        return await asyncio.open_connection(self.host, self.port)

    async def close(self, connections) -> None:
        for _, writer in connections:
            writer.close()

    async def __call__(self, connection, index: int) -> int:
        reader, writer = connection
        data = body(index, self.group_size)
        writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        return len(json.loads(await reader.readexactly(length))["choices"])


class Aiohttp:
    def __init__(self, url: str, group_size: int, concurrency: int) -> None:
        import aiohttp

        self.url, self.group_size = url.rstrip("/") + "/chat/completions", group_size
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60),
                                             headers={"Content-Type": "application/json"})

    async def open(self):
        return self.session

    async def close(self, connections) -> None:
        await self.session.close()

    async def __call__(self, session, index: int) -> int:
        async with session.post(self.url, data=body(index, self.group_size)) as response:
            return len(json.loads(await response.read())["choices"])


class Httpx:
    PER_POOL = 8

    def __init__(self, url: str, group_size: int, concurrency: int) -> None:
        import httpx

        self.url, self.group_size = url.rstrip("/") + "/chat/completions", group_size
        pools = max(1, -(-concurrency // self.PER_POOL))
        self.clients = [httpx.AsyncClient(limits=httpx.Limits(max_connections=self.PER_POOL), timeout=60)
                        for _ in range(pools)]
        self.opened = 0

    async def open(self):
        self.opened += 1
        return self.clients[self.opened % len(self.clients)]

    async def close(self, connections) -> None:
        for client in self.clients:
            await client.aclose()

    async def __call__(self, client, index: int) -> int:
        response = await client.post(self.url, content=body(index, self.group_size),
                                     headers={"Content-Type": "application/json"})
        return len(json.loads(response.content)["choices"])


async def run_one(url: str, kind: str, groups: int, group_size: int, concurrency: int,
                  go: asyncio.Event | None = None) -> dict:
    """Open and warm `concurrency` connections, (wait for `go`,) then time `groups` calls over them."""
    if kind == "sockets":
        call = Sockets(url, group_size)
    elif kind == "aiohttp":
        call = Aiohttp(url, group_size, concurrency)
    else:
        call = Httpx(url, group_size, concurrency)
    connections = [await call.open() for _ in range(concurrency)]
    try:
        await _workers(connections, concurrency, call)  # warm: every connection opened and used once
        if go is not None:
            print("ready", flush=True)
            await go.wait()
        started = time.time()
        received = await _workers(connections, groups, call)
        ended = time.time()
    finally:
        await call.close(connections)
    return {"groups": groups, "choices": received, "started": started, "ended": ended}


def run(url: str, kind: str, groups: int, group_size: int, concurrency: int = 64, procs: int = 1,
        python: str = sys.executable) -> dict:
    """Split `groups` over `procs` processes (each with `concurrency` connections); groups/s over the whole span."""
    if procs == 1:
        result = asyncio.run(run_one(url, kind, groups, group_size, concurrency))
    else:
        share = [groups // procs + (1 if i < groups % procs else 0) for i in range(procs)]
        children = [subprocess.Popen([python, __file__, "--child", "--url", url, "--kind", kind, "--groups", str(n),
                                      "--group-size", str(group_size), "--concurrency", str(concurrency),
                                      *(["--return-token-ids"] if EXTRA else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for n in share]
        for child in children:  # each says "ready" once its client is built and warm
            assert child.stdout.readline().strip() == "ready"
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        parts = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
        if any(child.returncode for child in children):
            raise RuntimeError(f"a raw client process failed: {[child.returncode for child in children]}")
        result = {"groups": sum(p["groups"] for p in parts), "choices": sum(p["choices"] for p in parts),
                  "started": min(p["started"] for p in parts), "ended": max(p["ended"] for p in parts)}
    if result["choices"] != groups * group_size:
        raise RuntimeError(f"raw client got {result['choices']} choices, expected {groups * group_size}")
    result.update(kind=kind, procs=procs, concurrency=concurrency,
                  groups_per_s=result["groups"] / (result["ended"] - result["started"]))
    return result


def _child(args: argparse.Namespace) -> None:
    async def main() -> dict:
        go = asyncio.Event()

        async def wait_for_go() -> None:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            go.set()

        waiter = asyncio.create_task(wait_for_go())
        result = await run_one(args.url, args.kind, args.groups, args.group_size, args.concurrency, go=go)
        await waiter
        return result

    print(json.dumps(asyncio.run(main())), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:31500/v1")
    parser.add_argument("--kind", choices=("sockets", "aiohttp", "httpx"), default="sockets")
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64, help="connections per process")
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--return-token-ids", action="store_true", help="ask for token ids (vLLM's field)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.return_token_ids:
        EXTRA["return_token_ids"] = True
    if args.child:
        _child(args)
    else:
        print(json.dumps(run(args.url, args.kind, args.groups, args.group_size, args.concurrency, args.procs)))


if __name__ == "__main__":
    main()
