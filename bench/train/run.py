"""GRPO trainer throughput: tokens/s per optimizer step, and the share of a step spent waiting for data.

    python -m bench.train.run                    # starter policy, batch 64 x ~80 tokens, 3 interleaved rounds
    python -m bench.train.run --smoke            # tiny policy, seconds
    python -m bench.train.run --device cuda      # on a GPU: bf16 autocast, MFU against the GPU's bf16 peak

Two sides, interleaved (harness): `store` trains on batches packed from a shard store run in-process
(no waiting to speak of), `api` pulls the same batches over HTTP from a real `run-api` following that run,
so `wait share` is the time between steps spent in /batch. Batches are InternBootcamp-shaped synthetic
groups (8 x (prompt 64 + completion 16) tokens) so the number does not depend on the inference server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Side, add_bench_args, compare, json_path, pairs_from, print_comparison

BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0, "A10": 125.0}


def peak_tflops(name: str) -> float | None:
    for key, value in BF16_PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def make_store(root: Path, groups: int, vocab: int) -> None:
    from factory.store import ShardStore
    from factory.synthetic import synthetic_groups

    ShardStore(root).commit("bench", "p", 0, synthetic_groups(groups, group_size=8, seq_len=80, prompt_len=64,
                                                              vocab=vocab, seed=1))


def run_side(kind: str, args: argparse.Namespace, store: Path, api_url: str | None) -> dict[str, float]:
    from factory.train.config import TrainJobConfig
    from factory.train.loop import run_training

    out = Path(tempfile.mkdtemp(prefix=f"bench-train-{kind}-"))
    try:
        cfg = TrainJobConfig.model_validate({
            "train": {"model_path": args.model, "output_dir": str(out), "batch_size": args.batch_size,
                      "total_steps": args.steps + 1, "checkpoint_every": 10_000, "threads": args.threads,
                      "device": args.device, "optim": {"micro_batch_size": args.micro_batch_size}},
            "source": ({"kind": "api", "api_url": api_url, "poll_s": 0.01} if kind == "api"
                       else {"kind": "store", "store_root": str(store), "runs": ["bench"]}),
        })
        run_training(cfg)  # on the API side every round re-registers at step 0 and is replayed the same batches
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]  # skip warm-up step
    finally:
        shutil.rmtree(out, ignore_errors=True)
    compute = sum(r["compute_s"] for r in rows)
    wait = sum(r["wait_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    result = {"tokens/s": tokens / compute, "steps/s": len(rows) / (compute + wait), "wait share": wait / (compute + wait)}
    if args.device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        peak = peak_tflops(name)
        if peak:
            params = args._params
            result["MFU %"] = 100 * 6 * params * result["tokens/s"] / (peak * 1e12)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(parser)
    parser.add_argument("--model", default=None, help="policy directory (default: starter policy; tiny one with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10; 2 with --smoke)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64; 16 with --smoke)")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 10)
    args.batch_size = args.batch_size or (16 if args.smoke else 64)
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        if args.model is None:
            if args.smoke:
                from factory.inference.tiny_model import make_tiny_policy

                args.model = str(make_tiny_policy(work / "policy"))
            else:
                args.model = str(Path(__file__).resolve().parents[2] / "models" / "starter-policy")
        from transformers import AutoConfig, AutoModelForCausalLM

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        args._params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(args.model).parameters())
        groups = (args.steps + 1) * args.batch_size // 8 + 1
        make_store(work / "store", groups, vocab)
        pairs = pairs_from(args)

        from factory.inference.local_server import free_port
        from factory.serve.client import ApiProcess

        port = free_port()
        api = ApiProcess([sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
                          "--store_root", str(work / "store"), "--follow_runs", "[bench]", "--follow_interval_s", "0.1",
                          "--log_level", "warning"], port, log_path=str(work / "api.log")).start()
        try:
            out = json_path("train", args)
            result = compare("train", [Side("store", lambda: run_side("store", args, work / "store", None)),
                                       Side("api", lambda: run_side("api", args, work / "store", api.url))],
                             pairs=pairs, json_out=out, label=f"{args.device} {Path(args.model).name} "
                             f"batch {args.batch_size} params {args._params}")
        finally:
            api.stop()
        device = args.device
        if device == "cuda":
            import torch

            device = f"cuda ({torch.cuda.get_device_name(0)})"
        print_comparison(result, title=f"GRPO trainer on {device}: {Path(args.model).name} ({args._params / 1e6:.2f}M params), "
                         f"batch {args.batch_size} x 80 tokens", json_out=out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
