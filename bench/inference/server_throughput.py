"""Local policy server throughput: generated tokens/s for concurrent requests vs calling the engine in-process.

    python -m bench.inference.server_throughput --model models/starter-policy --requests 32

Same prompts (InternBootcamp cases through the chat template) and the same
per-request seeds in every mode, so every mode generates the same tokens.
The ratio server / in-process batched is the server's overhead (HTTP, JSON,
queueing); in-process one-by-one shows what batching buys.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from environments.bootcamp_tasks import FAMILIES
from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.engine import GenRequest, PolicyEngine
from factory.inference.local_server import start_local_server
from factory.inference.types import SamplingParams


def prompts(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(0)
    names = sorted(FAMILIES)
    out = []
    for _ in range(count):
        case = FAMILIES[rng.choice(names)].generate(rng, 1)
        text = tokenizer.apply_chat_template([{"role": "user", "content": case.prompt}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def in_process(engine: PolicyEngine, batch: list[GenRequest], *, one_by_one: bool) -> tuple[int, float]:
    start = time.perf_counter()
    results = [r for req in batch for r in engine.generate_batch([req])] if one_by_one else engine.generate_batch(batch)
    return sum(len(r.output_ids) for r in results), time.perf_counter() - start


async def over_http(base_url: str, ids: list[list[int]], max_tokens: int) -> tuple[int, float]:
    async with InferenceClient(InferenceConfig(base_url=base_url)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            client.generate(p, n=1, sampling=SamplingParams(max_tokens=max_tokens, seed=i)) for i, p in enumerate(ids)))
        elapsed = time.perf_counter() - start
    return sum(len(r[0].output_token_ids) for r in results), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/starter-policy")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the server")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = PolicyEngine(args.model)
    ids = prompts(engine.tokenizer, args.requests)
    batch = [GenRequest(p, max_new_tokens=args.max_tokens, seed=i) for i, p in enumerate(ids)]
    best: dict[str, tuple[int, float]] = {}

    def keep(name: str, result: tuple[int, float]) -> None:
        if name not in best or result[1] < best[name][1]:
            best[name] = result

    with start_local_server(args.model, extra_args=["--threads", str(args.threads)]) as server:
        asyncio.run(over_http(server.base_url, ids[:4], 4))  # warm up
        for _ in range(args.rounds):
            keep("in-process batched", in_process(engine, batch, one_by_one=False))
            keep("server, concurrent HTTP", asyncio.run(over_http(server.base_url, ids, args.max_tokens)))
            keep("in-process one by one", in_process(engine, batch, one_by_one=True))
    base_tokens, base_s = best["in-process batched"]
    print(f"\nlocal server: {args.requests} concurrent requests, max_tokens {args.max_tokens}, {args.threads} torch "
          f"thread(s), best of {args.rounds}, model {args.model}")
    print(f"{'mode':<26}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'vs in-process':>15}")
    for name, (tokens, seconds) in best.items():
        print(f"{name:<26}{tokens:>8}{seconds:>9.2f}{tokens / seconds:>10.0f}"
              f"{(tokens / seconds) / (base_tokens / base_s):>14.2f}x")


if __name__ == "__main__":
    main()
