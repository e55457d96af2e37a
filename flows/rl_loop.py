"""The whole RL loop in one command, offline on a laptop CPU:

    python -m flows.rl_loop                       # defaults below (deployments/rl_loop.yaml), 10-minute budget
    python -m flows.rl_loop --budget_s 300 --eval_items 400 --out_dir runs/rl-short

1. held-out eval of the starting policy (in-process, the server's engine, fixed seeds)
2. local Prefect stack (`factory-local`'s LocalPrefect, in <out_dir>/prefect)
3. CPU policy server with the starter policy (version 0)
4. batching API following the datagen run (`--max_policy_lag` bounds staleness)
5. InternBootcamp datagen in `serve` mode (a Prefect flow run, backpressure against the API)
6. the `train-grpo` flow: /register, /batch, step, checkpoint + push every K steps -> policy version = step
7. stop after `budget_s` of training (or `total_steps`), stop everything, eval the final checkpoint the same way
8. print the before/after table (n, standard error), where the curve is, and where the time went

Everything it made stays in `out_dir` (report.json, report.md, logs, store, checkpoints, reward_curve.png).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from factory.config import FactoryConfig, build_config, split_config_path

ROOT = Path(__file__).resolve().parents[1]


class RLLoopConfig(FactoryConfig):
    """The loop's knobs (flat keys: `--budget_s 300`). Defaults are the measured default config."""

    out_dir: str = Field("runs/rl-loop", description="Everything the loop makes goes here (wiped at start).")
    policy: str = Field("models/starter-policy", description="Starting policy directory.")
    budget_s: float = Field(600.0, gt=0, description="Wall-clock seconds of training (the trainer stops after a checkpoint).")
    total_steps: int = Field(400, ge=1, description="Most trainer steps.")
    families: list[str] = Field(["gcd", "sorting", "string_transform", "modulo"],
                                description="InternBootcamp families, equal weights (the mix trained and evaluated).")
    difficulties: list[int] = Field([1], description="Difficulty levels.")
    group_size: int = Field(8, ge=2, description="Responses per problem.")
    batch_size: int = Field(64, ge=1, description="Sequences per trainer step.")
    lr: float = Field(3e-4, gt=0, description="Trainer learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Trainer linear warmup steps.")
    checkpoint_every: int = Field(2, ge=1, description="Checkpoint + weight push every K steps.")
    max_policy_lag: int = Field(4, ge=0, description="Batching API skips groups more than this many versions old.")
    max_batches_offpolicy: int = Field(2, ge=0, description="Datagen pauses while this many batches wait.")
    chunk_items: int = Field(8, ge=1, description="Problems per datagen chunk (one shard).")
    datagen_items: int = Field(20000, ge=1, description="Problems datagen may make (it is stopped when training ends; "
                                                        "the flow lists its chunks at start, so keep this modest).")
    eval_items: int = Field(600, ge=1, description="Held-out eval problems (one sample each, temperature 1).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for datagen and eval.")
    max_tokens: int = Field(24, ge=1, description="Most new tokens per answer.")
    train_config: str = Field("deployments/train_grpo.yaml", description="Trainer YAML the loop's keys override.")
    env_config: str = Field("deployments/intern_bootcamp.yaml", description="Datagen YAML the loop's keys override.")


def _free_port() -> int:
    from factory.inference.local_server import free_port

    return free_port()


def _env_for_eval(cfg: RLLoopConfig):
    from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv

    return InternBootcampEnv(InternBootcampConfig(weights={f: 1.0 for f in cfg.families}, difficulties=cfg.difficulties,
                                                  tokenizer_name=cfg.policy))


def _stop(process: subprocess.Popen | None, sig: int = signal.SIGINT, timeout: float = 20) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_loop(cfg: RLLoopConfig) -> dict[str, Any]:
    from factory.inference.local_server import launch_local_server
    from factory.local_prefect import LocalPrefect
    from factory.serve.client import ApiProcess
    from factory.train.evaluate import heldout_accuracy

    out = Path(cfg.out_dir).absolute()
    trainer_dir = trainer_dir_of(out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    policy = str(Path(cfg.policy).absolute())
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    env = _env_for_eval(cfg)
    print(f"== before: held-out eval of {cfg.policy} on {cfg.eval_items} items ({', '.join(cfg.families)})", flush=True)
    before = heldout_accuracy(policy, env, n=cfg.eval_items, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    phases["eval_before_s"] = before.seconds
    print(f"   accuracy {before.accuracy:.3f} ± {before.stderr:.3f}", flush=True)

    started = time.monotonic()
    prefect = LocalPrefect(home=out / "prefect", port=_free_port())
    server = api = datagen = trainer = None
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    try:
        print("== local Prefect stack, policy server, batching API", flush=True)
        prefect.up(worker=False)
        pf_env = {**base_env, **prefect.environ()}
        server = launch_local_server(policy, _free_port(), log_path=out / "logs" / "policy-server.log")
        api_port = _free_port()
        api = ApiProcess([sys.executable, "-m", "factory.serve.cli", "--port", str(api_port), "--host", "127.0.0.1",
                          "--store_root", str(out / "store"), "--follow_runs", "[rl]", "--follow_interval_s", "0.2",
                          "--batch_metadata", "true", "--max_policy_lag", str(cfg.max_policy_lag),
                          "--log_level", "warning"], api_port, env=base_env,
                         log_path=str(out / "logs" / "api.log")).start(timeout=120)
        phases["startup_s"] = time.monotonic() - started

        print(f"== datagen (serve mode) + train-grpo for {cfg.budget_s:.0f} s / {cfg.total_steps} steps", flush=True)
        weights = "{" + ", ".join(f"{f}: 1.0" for f in cfg.families) + "}"
        datagen_cmd = [
            sys.executable, str(ROOT / "environments" / "intern_bootcamp.py"), "serve", "--config", str(ROOT / cfg.env_config),
            "--env.weights", weights, "--env.difficulties", json.dumps(cfg.difficulties),
            "--env.group_size", str(cfg.group_size), "--env.total_items", str(cfg.datagen_items), "--env.tokenizer_name", policy,
            "--env.temperature", str(cfg.temperature), "--env.max_tokens", str(cfg.max_tokens),
            "--openai.base_url", server.base_url, "--datagen.run_id", "rl", "--datagen.store_root", str(out / "store"),
            "--datagen.chunk_items", str(cfg.chunk_items), "--datagen.chunks_in_flight", "2",
            "--serve.api_url", api.url, "--serve.max_batches_offpolicy", str(cfg.max_batches_offpolicy),
            "--serve.poll_s", "0.2",
        ]
        datagen = subprocess.Popen(datagen_cmd, env=pf_env, stdout=open(out / "logs" / "datagen.log", "ab"),
                                   stderr=subprocess.STDOUT, cwd=ROOT)
        train_cmd = [
            sys.executable, "-m", "flows.train", "--config", str(ROOT / cfg.train_config),
            "--train.model_path", policy, "--train.output_dir", str(trainer_dir),
            "--train.batch_size", str(cfg.batch_size), "--train.total_steps", str(cfg.total_steps),
            "--train.max_runtime_s", str(cfg.budget_s), "--train.checkpoint_every", str(cfg.checkpoint_every),
            "--train.optim.lr", str(cfg.lr),
            "--train.optim.warmup_steps", str(cfg.warmup_steps), "--source.api_url", api.url, "--push.endpoints", f"[{server.base_url}]",
        ]
        train_started = time.monotonic()
        trainer = subprocess.Popen(train_cmd, env=pf_env, stdout=open(out / "logs" / "trainer.log", "ab"),
                                   stderr=subprocess.STDOUT, cwd=ROOT)
        trainer.wait(timeout=cfg.budget_s + 900)
        phases["train_wall_s"] = time.monotonic() - train_started
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer exited with {trainer.returncode}; see {out / 'logs' / 'trainer.log'}")
    finally:
        stopping = time.monotonic()
        for process in (trainer, datagen):
            _stop(process)
        if api is not None:
            api.stop()
        if server is not None:
            server.stop()
        prefect.down()
        phases["shutdown_s"] = time.monotonic() - stopping

    from factory.train.trainer import latest_checkpoint

    final = latest_checkpoint(trainer_dir)
    print(f"== after: held-out eval of {final}", flush=True)
    after = heldout_accuracy(final, env, n=cfg.eval_items, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    phases["eval_after_s"] = after.seconds
    phases["total_s"] = time.monotonic() - t0
    report = _report(cfg, out, before, after, phases)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report["markdown"])
    print(report["markdown"], flush=True)
    return report


def trainer_dir_of(out: Path) -> Path:
    """Checkpoints and metrics sit beside the run's shards, where `view-run --store <out>/store` shows the curve."""
    return out / "store" / "rl" / "train"


def _report(cfg: RLLoopConfig, out: Path, before: Any, after: Any, phases: dict[str, float]) -> dict[str, Any]:
    trainer_dir = trainer_dir_of(out)
    rows = [json.loads(line) for line in (trainer_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = len(rows)
    total = lambda key: sum(r.get(key) or 0.0 for r in rows)  # noqa: E731
    inference_s = 0.0
    chunks = 0
    for path in (out / "store" / "rl").glob("stats-intern-bootcamp-*.json"):
        inference_s += json.loads(path.read_text()).get("generate_s", 0.0)
        chunks += 1
    diff = after.accuracy - before.accuracy
    diff_se = (before.stderr ** 2 + after.stderr ** 2) ** 0.5
    lines = [
        f"## RL loop: {', '.join(cfg.families)} (difficulty {cfg.difficulties}), group {cfg.group_size}, "
        f"batch {cfg.batch_size}, lr {cfg.lr}, {steps} steps in {phases.get('train_wall_s', 0):.0f} s",
        "",
        "| policy | held-out accuracy | n | std. error |",
        "|---|---|---|---|",
        f"| before ({cfg.policy}) | {before.accuracy:.3f} | {before.n} | {before.stderr:.3f} |",
        f"| after (step {steps}) | {after.accuracy:.3f} | {after.n} | {after.stderr:.3f} |",
        f"| change | {diff:+.3f} | | {diff_se:.3f} |",
        "",
        "| family | before | after |",
        "|---|---|---|",
    ]
    for family, (c, n) in before.per_family.items():
        ca, na = after.per_family.get(family, (0, 0))
        lines.append(f"| {family} | {c / n:.3f} | {ca / na if na else 0:.3f} |")
    lines += [
        "",
        "| where the time went | seconds |",
        "|---|---|",
        *(f"| {k} | {v:.1f} |" for k, v in phases.items()),
        f"| trainer compute (sum of steps) | {total('compute_s'):.1f} |",
        f"| trainer waiting for batches | {total('wait_s'):.1f} |",
        f"| checkpoint save | {total('save_s'):.1f} |",
        f"| weight push (update_weights_from_disk) | {total('push_s'):.1f} |",
        f"| datagen inference (sum over {chunks} chunks; chunks overlap) | {inference_s:.1f} |",
        "",
        f"reward curve: {trainer_dir / 'reward_curve.png'}; metrics: {trainer_dir / 'metrics.jsonl'}",
    ]
    if rows:
        first = sum(r["reward_mean"] for r in rows[:5]) / min(5, len(rows))
        last = sum(r["reward_mean"] for r in rows[-5:]) / min(5, len(rows))
        lines.append(f"batch reward mean, first 5 steps -> last 5: {first:.3f} -> {last:.3f}; "
                     f"mean policy lag {total('policy_lag') / steps:.2f}")
    return {"config": cfg.model_dump(mode="json"), "before": before.accuracy, "after": after.accuracy,
            "n": before.n, "stderr_before": before.stderr, "stderr_after": after.stderr, "change": diff,
            "change_stderr": diff_se, "steps": steps, "phases": phases, "trainer_compute_s": total("compute_s"),
            "trainer_wait_s": total("wait_s"), "save_s": total("save_s"), "push_s": total("push_s"),
            "datagen_inference_s": inference_s, "curve": str(trainer_dir / "reward_curve.png"),
            "markdown": "\n".join(lines) + "\n"}


def main(argv: list[str] | None = None) -> None:
    yaml_path, overrides = split_config_path(list(sys.argv[1:] if argv is None else argv))
    cfg = build_config(RLLoopConfig, yaml_path=yaml_path or (ROOT / "deployments" / "rl_loop.yaml"), cli_args=overrides)
    run_loop(cfg)


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.rl_loop", main))
