"""Distributed GRPO trainer: step time and tokens/s per rank, 2 ranks vs 1 rank (torchrun, FSDP2), same batches.

    python -m bench.train.dist                   # starter policy, batch 64 x 80 tokens, 3 interleaved rounds (CPU, gloo)
    python -m bench.train.dist --smoke           # tiny policy, 1 round
    python -m bench.train.dist --device cuda --model <1B dir> --seq-len 4096 --batch-size 16 --micro-batch-size 2
                                                 # on a GPU node: bf16 FSDP2, MFU against the GPU's bf16 peak

Each side is one real `torchrun --standalone -m flows.train` job on a shard store of
synthetic groups (8 x (prompt + completion) tokens, the same for both sides);
the first step (warm-up) is not timed. `step s` is the median compute time of a
step, `tokens/s/rank` the step's tokens over its time over the rank count. On
CPU the ranks share the machine's cores, so 2 ranks only gain when there are
cores to spare (`--threads` per rank); MFU is reported only with CUDA
(6 x params x tokens/s / (ranks x peak bf16 FLOPs)).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import Side, add_bench_args, compare, json_path, pairs_from, print_comparison
from bench.train.run import peak_tflops

REPO = Path(__file__).resolve().parents[2]


def make_store(root: Path, groups: int, vocab: int, seq_len: int) -> None:
    from factory.store import ShardStore
    from factory.synthetic import synthetic_groups

    prompt = max(1, seq_len * 4 // 5)
    ShardStore(root).commit("bench", "p", 0, synthetic_groups(groups, group_size=8, seq_len=seq_len, prompt_len=prompt,
                                                              vocab=vocab, seed=1))


def run_side(ranks: int, args: argparse.Namespace, store: Path) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix=f"bench-train-dist-{ranks}-"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "flows.train", "--source.kind", "store", "--source.store_root", str(store), "--source.runs", "[bench]",
               "--train.model_path", args.model, "--train.output_dir", str(out),
               "--train.batch_size", str(args.batch_size), "--train.total_steps", str(args.steps + 1),
               "--train.checkpoint_every", "100000", "--train.threads", str(args.threads), "--train.device", args.device,
               "--train.optim.micro_batch_size", str(args.micro_batch_size),
               "--train.gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{ranks}-rank job failed: {done.stderr[-2000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    step_s = statistics.median(r["compute_s"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    result = {"step s": step_s, "tokens/s": tokens / step_s, "tokens/s/rank": tokens / step_s / ranks}
    if args.device == "cuda":
        import torch

        peak = peak_tflops(torch.cuda.get_device_name(0))
        if peak:
            result["MFU %"] = 100 * 6 * args._params * result["tokens/s/rank"] / (peak * 1e12)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(parser)
    parser.add_argument("--model", default=None, help="policy directory (default: starter policy; tiny one with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per job (default 8; 2 with --smoke)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64; 16 with --smoke)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward (default 16; 8 smoke)")
    parser.add_argument("--seq-len", type=int, default=80, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the side compared with 1 rank")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one job may take")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 8)
    args.batch_size = args.batch_size or (16 if args.smoke else 64)
    args.micro_batch_size = args.micro_batch_size or (8 if args.smoke else 16)
    work = Path(tempfile.mkdtemp(prefix="bench-train-dist-"))
    try:
        if args.model is None:
            if args.smoke:
                from factory.inference.tiny_model import make_tiny_policy

                args.model = str(make_tiny_policy(work / "policy"))
            else:
                args.model = str(REPO / "models" / "starter-policy")
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.model)
        args._params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        make_store(work / "store", (args.steps + 1) * args.batch_size // 8 + 1, config.vocab_size, args.seq_len)
        out = json_path("train-dist", args)
        label = (f"{args.device} {Path(args.model).name} batch {args.batch_size} x {args.seq_len} tokens, "
                 f"micro-batch {args.micro_batch_size}, {args.threads} thread(s)/rank, params {args._params}")
        result = compare("train-dist", [Side("1 rank", lambda: run_side(1, args, work / "store")),
                                        Side(f"{args.ranks} ranks", lambda: run_side(args.ranks, args, work / "store"))],
                         pairs=pairs_from(args), json_out=out, label=label)
        mfu = "" if args.device == "cuda" else " (no CUDA here: MFU not reported)"
        print_comparison(result, title=f"Distributed GRPO trainer, {args.ranks} ranks vs 1: {label}{mfu}", json_out=out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
