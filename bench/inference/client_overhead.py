"""Client overhead: the factory InferenceClient vs a plain openai.AsyncOpenAI loop, same instant server, same concurrency.

    python -m bench.inference.client_overhead --calls 2000 --concurrency 32

The server is the instant fault server (no faults) in its own process; runs
alternate between the two clients and the best of `--rounds` is kept for each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
import openai

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "factory.inference.fault_server", "--port", str(port)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(base_url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        best = {"openai.AsyncOpenAI chat": 0.0, "factory chat": 0.0, "factory generate": 0.0}
        runners = {"openai.AsyncOpenAI chat": openai_loop, "factory chat": factory_chat,
                   "factory generate": factory_generate}
        asyncio.run(openai_loop(base_url, 100, args.concurrency))  # warm up both sides
        for _ in range(args.rounds):
            for name, runner in runners.items():
                best[name] = max(best[name], asyncio.run(runner(base_url, args.calls, args.concurrency)))
    finally:
        server.terminate()
        server.wait()
    base = best["openai.AsyncOpenAI chat"]
    print(f"\nclient overhead: {args.calls} calls, concurrency {args.concurrency}, best of {args.rounds}")
    print(f"{'client':<26}{'calls/s':>10}{'vs openai':>11}")
    for name, rate in best.items():
        print(f"{name:<26}{rate:>10.0f}{rate / base:>10.2f}x")


if __name__ == "__main__":
    main()
