"""Client overhead: the factory InferenceClient vs a plain openai.AsyncOpenAI loop, same instant server, same concurrency.

    python -m bench.inference.client_overhead --calls 2000 --concurrency 32   # or: python -m bench.inference.run

The server is the instant fault server (no faults) in its own process; the
clients run in interleaved rounds (bench/harness.py), ratios to the OpenAI SDK
within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from bench import harness
from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.local_server import free_port

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


async def _pool(calls: int, concurrency: int, one) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with semaphore:
            await one()

    start = time.perf_counter()
    await asyncio.gather(*(bounded() for _ in range(calls)))
    return calls / (time.perf_counter() - start)


async def openai_loop(base_url: str, calls: int, concurrency: int) -> float:
    sdk = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                             http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)))
    try:
        return await _pool(calls, concurrency, lambda: sdk.chat.completions.create(
            model="m", messages=MESSAGES, n=1, max_tokens=4, temperature=1.0, logprobs=True))
    finally:
        await sdk.close()


async def factory_chat(base_url: str, calls: int, concurrency: int) -> float:
    config = InferenceConfig(base_url=base_url + "/v1", model_name="m", num_max_requests_at_once=concurrency)
    async with InferenceClient(config) as client:
        return await _pool(calls, concurrency, lambda: client.chat(MESSAGES, n=1))


async def factory_generate(base_url: str, calls: int, concurrency: int) -> float:
    config = InferenceConfig(base_url=base_url, num_max_requests_at_once=concurrency)
    async with InferenceClient(config) as client:
        return await _pool(calls, concurrency, lambda: client.generate([1, 2, 3, 4], n=1))


def compare_clients(calls: int, concurrency: int, pairs: int, json_out: Path | None) -> harness.Comparison:
    """The three clients in interleaved rounds against one instant fault server (no faults) in its own process."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "factory.inference.fault_server", "--port", str(port)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(base_url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(openai_loop(base_url, min(calls, 100), concurrency))  # warm up the server and the imports
        sides = [harness.Side(name, lambda runner=runner: asyncio.run(runner(base_url, calls, concurrency)))
                 for name, runner in (("openai.AsyncOpenAI chat", openai_loop), ("factory chat", factory_chat),
                                      ("factory generate (SGLang /generate)", factory_generate))]
        return harness.compare("inference", sides, pairs=pairs, metric="calls/s", json_out=json_out,
                               label=f"client overhead, {calls} calls, concurrency {concurrency}")
    finally:
        server.terminate()
        server.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.concurrency = 64, 8
    json_out = harness.json_path("inference", args)
    result = compare_clients(args.calls, args.concurrency, harness.pairs_from(args), json_out)
    harness.print_comparison(result, title=f"client overhead: {args.calls} calls, concurrency {args.concurrency}",
                             json_out=json_out)


if __name__ == "__main__":
    main()
