"""Local policy server throughput: generated tokens/s for concurrent requests vs calling the engine in-process.

    python -m bench.inference.server_throughput --model models/starter-policy --requests 32
    python -m bench.inference.run --only server --smoke

Same prompts (InternBootcamp cases through the chat template) and the same
per-request seeds in every mode, so every mode generates the same tokens.
The ratio server / in-process batched is the server's overhead (HTTP, JSON,
queueing); in-process one-by-one shows what batching buys. The modes run in
interleaved rounds (bench/harness.py), ratios within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import torch

from bench import harness
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


def compare_modes(model: str, requests: int, max_tokens: int, threads: int, pairs: int,
                  json_out: Path | None) -> harness.Comparison:
    """In-process batched (the baseline), the server over HTTP and in-process one by one, in interleaved rounds."""
    torch.set_num_threads(threads)
    engine = PolicyEngine(model)
    ids = prompts(engine.tokenizer, requests)
    batch = [GenRequest(p, max_new_tokens=max_tokens, seed=i) for i, p in enumerate(ids)]

    def rate(result: tuple[int, float]) -> dict:
        tokens, seconds = result
        return {"tokens/s": tokens / seconds, "tokens": tokens}

    with start_local_server(model, extra_args=["--threads", str(threads)]) as server:
        asyncio.run(over_http(server.base_url, ids[:4], 4))  # warm up
        return harness.compare("inference", [
            harness.Side("in-process batched", lambda: rate(in_process(engine, batch, one_by_one=False))),
            harness.Side("server, concurrent HTTP",
                         lambda: rate(asyncio.run(over_http(server.base_url, ids, max_tokens)))),
            harness.Side("in-process one by one", lambda: rate(in_process(engine, batch, one_by_one=True))),
        ], pairs=pairs, json_out=json_out, label=f"local server, {requests} requests, model {model}")


def default_model() -> str:
    """models/starter-policy when built, else a tiny random policy (made once under bench/out/)."""
    starter = Path(__file__).resolve().parents[2] / "models" / "starter-policy"
    if (starter / "config.json").is_file():
        return str(starter)
    from factory.inference.tiny_model import make_tiny_policy

    tiny = Path(__file__).resolve().parents[2] / "bench" / "out" / "tiny-policy"
    if not (tiny / "config.json").is_file():
        make_tiny_policy(tiny)
    return str(tiny)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: models/starter-policy, else a tiny random policy")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the server")
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.max_tokens = 4, 8
    model = args.model or default_model()
    json_out = harness.json_path("inference", args)
    result = compare_modes(model, args.requests, args.max_tokens, args.threads, harness.pairs_from(args), json_out)
    harness.print_comparison(result, title=f"local server: {args.requests} concurrent requests, max_tokens "
                                           f"{args.max_tokens}, {args.threads} torch thread(s), model {model}",
                             json_out=json_out)


if __name__ == "__main__":
    main()
