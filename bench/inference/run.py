"""Inference benches under the uniform entry point: client overhead, then the local CPU policy server.

    python -m bench.inference.run                    # both, default sizes, 3 interleaved rounds each
    python -m bench.inference.run --only client --calls 2000 --concurrency 32
    python -m bench.inference.run --smoke            # seconds (CI)

Each part is also its own module (bench/inference/client_overhead.py,
bench/inference/server_throughput.py) with its full set of options.
"""

from __future__ import annotations

import argparse
import os

from bench import harness


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("client", "server"), default=None)
    parser.add_argument("--calls", type=int, default=2000, help="client overhead: calls per side and round")
    parser.add_argument("--concurrency", type=int, default=32, help="client overhead: calls in flight")
    parser.add_argument("--model", default=None, help="server: default models/starter-policy, else a tiny policy")
    parser.add_argument("--requests", type=int, default=32, help="server: concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=48, help="server: new tokens per request")
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        args.calls, args.concurrency, args.requests, args.max_tokens = 64, 8, 4, 8
    pairs, json_out = harness.pairs_from(args), harness.json_path("inference", args)
    if args.only in (None, "client"):
        from bench.inference.client_overhead import compare_clients

        result = compare_clients(args.calls, args.concurrency, pairs, json_out)
        harness.print_comparison(result, title=f"client overhead: {args.calls} calls, concurrency {args.concurrency}",
                                 json_out=json_out)
    if args.only in (None, "server"):
        from bench.inference.server_throughput import compare_modes, default_model

        model = args.model or default_model()
        result = compare_modes(model, args.requests, args.max_tokens, 1, pairs, json_out)
        harness.print_comparison(result, title=f"local server: {args.requests} concurrent requests, max_tokens "
                                               f"{args.max_tokens}, 1 torch thread, model {model}", json_out=json_out)


if __name__ == "__main__":
    main()
