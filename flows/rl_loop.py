"""`rl-loop`: the whole RL loop as one Prefect flow, offline on a laptop CPU.

    python -m flows.rl_loop                                   # deployments/rl_loop.yaml: 900 s (15 minutes) of training, seed 0
    python -m flows.rl_loop --budget_s 300 --seed 1 --out_dir runs/rl-short
    python -m flows.rl_loop --total_steps 50                  # stop after exactly 50 steps instead
    prefect deployment run rl-loop/rl-loop                    # the same flow from the UI / a work pool

Stopping rule: the run trains for `budget_s` seconds of wall clock (the trainer stops at the first step
boundary after it) unless `total_steps` is given, in which case it trains exactly that many steps.

1. checks (before anything starts): starter policy present, budget long enough for one step, families known;
   eval sets of distinct eval-side problems (content split: environments/bootcamp_tasks/split.py) at the
   trained level and one above; the planned training items' overlap with them printed and required to be 0
2. eval of the starting policy on those sets: greedy and temperature 1, n and 95% interval
3. CPU policy server (version 0), batching API (`max_policy_lag` bounds staleness), InternBootcamp datagen in
   `serve` mode on the train side only, the `train-grpo` flow (checkpoint + push every K steps)
4. stop everything, count how many trained problems are in the eval sets (0), eval the final checkpoint again
5. report: report.json / report.md / eval.jsonl / report.png in `out_dir`, a markdown artifact on the flow run

With no Prefect server configured (`PREFECT_API_URL` unset), `main` starts a local one in `<out_dir>/prefect`
for the length of the run, so this flow and the datagen and trainer flows it starts show in one UI.
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

import httpx
from prefect import flow, get_run_logger
from pydantic import ValidationError

from factory.config import build_config, deployment_sections, split_config_path
from factory.train.rl_plan import LoopInputError, RLLoopConfig, RLPlan, build_plan, check_inputs, check_plan, train_env

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "rl"
EVAL_TEMPERATURES = (0.0, 1.0)
__all__ = ["RLLoopConfig", "rl_loop", "run_loop", "main"]


def _free_port() -> int:
    from factory.inference.local_server import free_port

    return free_port()


def _stop(process: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGINT (a graceful stop), a second SIGINT after `grace_s` (abandon work in flight: training is over), kill."""
    if process is None or process.poll() is not None:
        return
    for _ in range(2):
        process.send_signal(signal.SIGINT)
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    process.kill()
    process.wait()


def trainer_dir_of(out: Path) -> Path:
    """Checkpoints and metrics sit beside the run's shards, where `view-run --store <out>/store` shows the curve."""
    return out / "store" / RUN_ID / "train"


def _fresh(out: Path) -> None:
    """Empty `out` but a local Prefect home in it (main may have started that server already)."""
    out.mkdir(parents=True, exist_ok=True)
    for child in out.iterdir():
        if child.name != "prefect":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    (out / "logs").mkdir()


def _say(line: str) -> None:
    print(line, flush=True)


def plan_summary(cfg: RLLoopConfig, plan: RLPlan) -> list[str]:
    lines = [f"train/eval overlap: {plan.overlap} problems ({plan.planned_train_items} planned training items vs "
             f"{sum(len(lv.evalset.cases) for lv in plan.levels)} eval problems; split by normalized prompt / "
             f"problem parameters, eval share {cfg.eval_share})"]
    for lv in plan.levels:
        small = ", ".join(f"{f} ({n} distinct)" for f, n in lv.evalset.too_small.items())
        lines.append(f"level {lv.level} ({lv.role}): headline {', '.join(lv.headline_families)}"
                     + (f"; left out, space too small: {small}" if small else ""))
    return lines


def evaluate_all(model: str, cfg: RLLoopConfig, plan: RLPlan) -> dict[tuple[int, str, float], Any]:
    """Greedy and temperature-1 accuracy on every eval level (one engine, fixed sampling seeds)."""
    from factory.inference.engine import PolicyEngine
    from factory.train.evaluate import evaluate_items

    env = train_env(cfg, side="eval")
    engine = PolicyEngine(model)
    results = {}
    for lv in plan.levels:
        items = [env._item(i, case) for i, case in enumerate(lv.evalset.cases)]
        for temperature in EVAL_TEMPERATURES:
            results[(lv.level, lv.role, temperature)] = evaluate_items(
                model, env, items, temperature=temperature, max_tokens=cfg.max_tokens, seed=cfg.seed, engine=engine)
    return results


def _server_busy(base_url: str) -> tuple[float, float]:
    try:
        info = httpx.get(f"{base_url.rstrip('/').removesuffix('/v1')}/get_model_info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return (0.0, 0.0)
    return float(info.get("busy_s", 0.0)), float(info.get("update_s", 0.0))


class BusySampler:
    """(wall time, the server's cumulative busy seconds) every `every_s` on a thread, so the busy share can be taken
    over the training window alone (the trainer's start-up, when nothing asks for rollouts, left out)."""

    def __init__(self, base_url: str, every_s: float = 2.0) -> None:
        import threading

        self.base_url, self.every_s = base_url, every_s
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-sampler", daemon=True)

    def start(self) -> BusySampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self._thread.join(timeout=15)
        return self.samples

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            stamp = time.time()
            busy, _ = _server_busy(self.base_url)
            if busy:
                self.samples.append((stamp, busy))


def trained_overlap(out: Path, plan: RLPlan) -> tuple[int, int]:
    """(eval problems among the problems datagen actually made, problems made), read from the run's shards."""
    import pyarrow.parquet as pq

    from environments.bootcamp_tasks import case_from_key
    from environments.bootcamp_tasks.split import overlap

    keys: set[str] = set()
    for shard in (out / "store" / RUN_ID).rglob("*.parquet"):
        keys.update(pq.read_table(shard, columns=["item_key"]).column("item_key").to_pylist())
    made = [case_from_key(k) for k in keys]
    return len(overlap(made, [c for lv in plan.levels for c in lv.evalset.cases])), len(made)


def run_loop(cfg: RLLoopConfig, log=_say) -> dict[str, Any]:
    """The loop (see the module docstring); raises LoopInputError before starting anything on bad input."""
    from factory.inference.local_server import launch_local_server
    from factory.serve.client import ApiProcess
    from factory.train import rl_report
    from factory.train.trainer import latest_checkpoint

    check_inputs(cfg, ROOT)
    t0 = time.monotonic()
    plan = build_plan(cfg)
    for line in plan_summary(cfg, plan):
        log(line)
    check_plan(plan)
    phases: dict[str, float] = {"plan_s": time.monotonic() - t0}

    out = Path(cfg.out_dir).absolute()
    _fresh(out)
    for lv in plan.levels:
        lv.evalset.save(out / f"eval-set-level{lv.level}.jsonl")
    trainer_dir = trainer_dir_of(out)
    policy = str(Path(cfg.policy) if Path(cfg.policy).is_absolute() else (ROOT / cfg.policy).absolute())
    headline = {lv.level: lv.headline_families for lv in plan.levels}

    log(f"== before: eval of {cfg.policy} (greedy and temperature 1)")
    began = time.monotonic()
    before = rl_report.eval_rows("before", evaluate_all(policy, cfg, plan), headline)
    rl_report.write_jsonl(out / "eval.jsonl", before)
    phases["eval_before_s"] = time.monotonic() - began
    for row in before:
        if row["family"] == "headline":
            log(f"   level {row['level']} T={row['temperature']:g}: {row['accuracy']:.3f} "
                f"({row['correct']}/{row['n']}, 95% CI {row['ci95'][0]:.3f}-{row['ci95'][1]:.3f})")

    started = time.monotonic()
    server = api = datagen = trainer = None
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    stop_rule = (f"{cfg.total_steps} steps" if cfg.total_steps is not None else f"{cfg.budget_s:g} s of training")
    busy0 = busy1 = (0.0, 0.0)
    sampler: BusySampler | None = None
    busy_samples: list[tuple[float, float]] = []
    try:
        log("== policy server, batching API")
        server = launch_local_server(policy, _free_port(), log_path=out / "logs" / "policy-server.log")
        api_port = _free_port()
        api = ApiProcess([sys.executable, "-m", "factory.serve.cli", "--port", str(api_port), "--host", "127.0.0.1",
                          "--store_root", str(out / "store"), "--follow_runs", f"[{RUN_ID}]", "--follow_interval_s", "0.2",
                          "--batch_metadata", "true", "--max_policy_lag", str(cfg.max_policy_lag),
                          "--log_level", "warning"], api_port, env=base_env,
                         log_path=str(out / "logs" / "api.log")).start(timeout=120)
        phases["startup_s"] = time.monotonic() - started

        log(f"== datagen (serve mode, train side of the split) + train-grpo until {stop_rule}")
        weights = "{" + ", ".join(f"{f}: 1.0" for f in cfg.families) + "}"
        datagen_cmd = [
            sys.executable, str(ROOT / "environments" / "intern_bootcamp.py"), "serve", "--config", str(ROOT / cfg.env_config),
            "--env.weights", weights, "--env.difficulties", json.dumps(cfg.difficulties), "--env.split", "train",
            "--env.eval_share", str(cfg.eval_share), "--env.seed", str(cfg.seed),
            "--env.group_size", str(cfg.group_size), "--env.total_items", str(cfg.datagen_items), "--env.tokenizer_name", policy,
            "--env.temperature", str(cfg.temperature), "--env.max_tokens", str(cfg.max_tokens),
            "--openai.base_url", server.base_url, "--datagen.run_id", RUN_ID, "--datagen.store_root", str(out / "store"),
            "--datagen.chunk_items", str(cfg.chunk_items), "--datagen.chunks_in_flight", "2",
            "--serve.api_url", api.url, "--serve.max_batches_offpolicy", str(cfg.max_batches_offpolicy),
            "--serve.poll_s", "0.2",
        ]
        datagen = subprocess.Popen(datagen_cmd, env=base_env, stdout=open(out / "logs" / "datagen.log", "ab"),
                                   stderr=subprocess.STDOUT, cwd=ROOT)
        steps = cfg.total_steps if cfg.total_steps is not None else 1_000_000
        train_cmd = [
            sys.executable, "-m", "flows.train", "--config", str(ROOT / cfg.train_config),
            "--train.model_path", policy, "--train.output_dir", str(trainer_dir), "--train.seed", str(cfg.seed),
            "--train.batch_size", str(cfg.batch_size), "--train.total_steps", str(steps),
            "--train.checkpoint_every", str(cfg.checkpoint_every), "--train.optim.lr", str(cfg.lr),
            "--train.optim.warmup_steps", str(cfg.warmup_steps), "--source.api_url", api.url,
            "--push.endpoints", f"[{server.base_url}]", "--push.background", "true",
            *(["--train.max_runtime_s", str(cfg.budget_s)] if cfg.total_steps is None else []),
        ]
        busy0 = _server_busy(server.base_url)
        sampler = BusySampler(server.base_url).start()
        train_started = time.monotonic()
        trainer = subprocess.Popen(train_cmd, env=base_env, stdout=open(out / "logs" / "trainer.log", "ab"),
                                   stderr=subprocess.STDOUT, cwd=ROOT)
        limit = cfg.budget_s + 900 if cfg.total_steps is None else max(3600.0, 60.0 * cfg.total_steps)
        trainer.wait(timeout=limit)
        phases["train_wall_s"] = time.monotonic() - train_started
        busy1 = _server_busy(server.base_url)
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer exited with {trainer.returncode}; see {out / 'logs' / 'trainer.log'}")
    finally:
        stopping = time.monotonic()
        if sampler is not None:
            busy_samples = sampler.stop()
        for process in (trainer, datagen):
            _stop(process)
        if api is not None:
            api.stop()
        if server is not None:
            server.stop()
        phases["shutdown_s"] = time.monotonic() - stopping

    trained_in_eval, made = trained_overlap(out, plan)
    log(f"problems datagen made: {made}; of them in the eval sets: {trained_in_eval}")
    final = latest_checkpoint(trainer_dir)
    log(f"== after: eval of {final}")
    began = time.monotonic()
    after = rl_report.eval_rows("after", evaluate_all(str(final), cfg, plan), headline)
    rl_report.write_jsonl(out / "eval.jsonl", after)
    phases["eval_after_s"] = time.monotonic() - began
    phases["total_s"] = time.monotonic() - t0

    metric_rows = [json.loads(line) for line in (trainer_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    total = lambda key: sum(r.get(key) or 0.0 for r in metric_rows)  # noqa: E731
    lags = [r["policy_lag"] for r in metric_rows if r.get("policy_lag") is not None]
    train_wall = phases.get("train_wall_s", 0.0)
    timing = {"trainer_compute_s": total("compute_s"), "trainer_wait_s": total("wait_s"), "save_s": total("save_s"),
              "push_s": total("push_s"), "server_busy_s": busy1[0] - busy0[0], "server_update_s": busy1[1] - busy0[1],
              "busy_share": (busy1[0] - busy0[0]) / train_wall if train_wall else None,
              "policy_lag_mean": sum(lags) / len(lags) if lags else None, "policy_lag_max": max(lags) if lags else None}
    window = rl_report.training_window(metric_rows)
    if window is not None:
        timing["training_window_s"] = window[1] - window[0]
        timing["busy_share_training"] = rl_report.busy_share_in(busy_samples, *window)
    table = rl_report.headline_table(before + after)
    title = (f"RL loop: {', '.join(cfg.families)} (difficulty {cfg.difficulties}), seed {cfg.seed}, group "
             f"{cfg.group_size}, batch {cfg.batch_size}, lr {cfg.lr}, {len(metric_rows)} steps in {train_wall:.0f} s "
             f"(stop rule: {stop_rule})")
    plan_lines = plan_summary(cfg, plan) + [f"problems trained on that are in the eval sets: {trained_in_eval} "
                                            f"(of {made} made)"]
    md = rl_report.markdown(title, table, plan_lines, phases, timing)
    png = rl_report.plot(out / "report.png", metric_rows, table)
    report = {"config": cfg.model_dump(mode="json"), "headline": table, "overlap_planned": plan.overlap,
              "overlap_trained": trained_in_eval, "problems_made": made, "planned_train_items": plan.planned_train_items,
              "levels": [{"level": lv.level, "role": lv.role, "headline": lv.headline_families,
                          "distinct": lv.evalset.distinct, "too_small": lv.evalset.too_small} for lv in plan.levels],
              "steps": len(metric_rows), "phases": phases, **timing, "png": str(png),
              "eval_rows": str(out / "eval.jsonl"), "metrics": str(trainer_dir / "metrics.jsonl"), "markdown": md}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(md)
    log(md)
    return report


def loop_config(loop: dict[str, Any] | None, config_path: str | None) -> RLLoopConfig:
    """The flow's preflight: the run's `loop` keys merged into its deployment's, over the YAML, validated and
    checked (starter policy, budget, families), so a wrong input fails in seconds with one line."""
    loop = deployment_sections(loop=loop).get("loop", {})  # a run's keys merge into the deployment's
    path = None if config_path is None else Path(config_path) if Path(config_path).is_absolute() else ROOT / config_path
    cfg = build_config(RLLoopConfig, yaml_path=path, values=loop)
    check_inputs(cfg, ROOT)
    return cfg


@flow(name="rl-loop", log_prints=False)
def rl_loop(loop: dict[str, Any] | None = None, config_path: str | None = "deployments/rl_loop.yaml") -> dict[str, Any]:
    """Eval, train with GRPO on the train side of the content split until the stop rule, eval again; returns the
    report (also a markdown artifact `rl-loop-report`)."""
    from prefect.artifacts import create_markdown_artifact

    logger = get_run_logger()
    cfg = loop_config(loop, config_path)
    report = run_loop(cfg, log=logger.info)
    create_markdown_artifact(key="rl-loop-report", markdown=report["markdown"],
                             description=f"RL loop report ({cfg.out_dir})")
    return report


def usage() -> str:
    """The module docstring and every key with its type, default and description (`--help`)."""
    from factory.config import config_help

    return config_help(RLLoopConfig, prog="python -m flows.rl_loop", description=__doc__.strip(),
                       extra_options=[("--config PATH", "YAML of the loop's keys (default deployments/rl_loop.yaml).")])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(usage())
        return 0
    yaml_path, overrides = split_config_path(args)
    try:
        cfg = build_config(RLLoopConfig, yaml_path=yaml_path or (ROOT / "deployments" / "rl_loop.yaml"), cli_args=overrides)
        check_inputs(cfg, ROOT)
    except ValidationError as error:
        first = error.errors()[0]
        print(f"rl-loop: {'.'.join(map(str, first['loc']))}: {first['msg']} (got {first.get('input')!r})", file=sys.stderr)
        return 2
    except (LoopInputError, ValueError) as error:
        print(f"rl-loop: {' '.join(line.strip() for line in str(error).splitlines()[:2])}", file=sys.stderr)
        return 2
    values = cfg.model_dump(mode="json")
    try:
        if os.environ.get("PREFECT_API_URL"):
            rl_loop(loop=values, config_path=None)
        else:
            from prefect.settings import PREFECT_API_URL, temporary_settings

            from factory.local_prefect import temporary_local_prefect

            home = Path(cfg.out_dir).absolute() / "prefect"
            shutil.rmtree(home, ignore_errors=True)
            with temporary_local_prefect(home, _free_port()) as environ:
                with temporary_settings(updates={PREFECT_API_URL: environ["PREFECT_API_URL"]}):
                    rl_loop(loop=values, config_path=None)
    except LoopInputError as error:
        print(f"rl-loop: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.rl_loop", main))
