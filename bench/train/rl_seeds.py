"""The RL loop over several seeds, each seed's numbers appended to bench/results/rl_loop.jsonl with its command.

    python -m bench.train.rl_seeds --seeds 0 1 2 --out_root /tmp/rl -- --budget_s 600
    python -m bench.train.rl_seeds --record /tmp/rl/s0 --command "bash scripts/rl_loop.sh --out_dir /tmp/rl/s0"

Rows: one per (seed, level, sampling) on the headline families (before, after, change, n, 95% intervals), and
one per (seed, level, sampling, family) with the pass rate before and after (the ladders: how far each family's
next level is from the trained one), plus the run's steps, busy share and policy lag, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import time
from pathlib import Path

from bench.harness import machine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "rl_loop.jsonl"


def record(run_dir: Path, command: str, out: Path = RESULTS) -> list[dict]:
    report = json.loads((run_dir / "report.json").read_text())
    cfg = report["config"]
    common = {"bench": "rl_loop", "command": command, "seed": cfg["seed"], "families": cfg["families"],
              "difficulties": cfg["difficulties"], "budget_s": cfg["budget_s"], "total_steps": cfg["total_steps"],
              "lr": cfg["lr"], "steps": report["steps"], "train_wall_s": round(report["phases"].get("train_wall_s", 0), 1),
              "busy_share": report.get("busy_share"),
              "busy_share_training": report.get("busy_share_training"), "policy_lag_mean": report.get("policy_lag_mean"),
              "policy_lag_max": report.get("policy_lag_max"), "overlap_planned": report["overlap_planned"],
              "overlap_trained": report["overlap_trained"], "recorded": time.time(), **machine()}
    rows = [{**common, "metric": "headline accuracy", **{k: v for k, v in row.items() if k != "families"},
             "headline_families": row["families"]} for row in report["headline"]]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    fam = {(r["phase"], r["level"], r["temperature"], r["family"]): r for r in evals if r["family"] != "headline"}
    for (phase, level, temperature, family), row in sorted(fam.items()):
        if phase != "before":
            continue
        after = fam.get(("after", level, temperature, family), {})
        rows.append({**common, "metric": "family pass rate", "level": level, "role": row["role"],
                     "temperature": temperature, "family": family, "headline": row["headline"], "n": row["n"],
                     "before": row["accuracy"], "after": after.get("accuracy")})
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--out_root", default="runs/rl-seeds")
    parser.add_argument("--record", help="only record an existing run directory")
    parser.add_argument("--command", help="the command that made --record's run")
    args, loop_args = parser.parse_known_args(argv)
    loop_args = [a for a in loop_args if a != "--"]
    if args.record:
        rows = record(Path(args.record), args.command or f"(run dir {args.record})")
        print(f"{len(rows)} rows -> {RESULTS}")
        return
    for seed in args.seeds:
        command = ["bash", "scripts/rl_loop.sh", "--seed", str(seed), "--out_dir", f"{args.out_root}/s{seed}", *loop_args]
        subprocess.run(command, cwd=ROOT, check=True)
        record(ROOT / args.out_root / f"s{seed}" if not Path(args.out_root).is_absolute() else
               Path(args.out_root) / f"s{seed}", shlex.join(command))


if __name__ == "__main__":
    main()
