"""`serve`: the batching flow. Runs the Atropos-compatible API over the shard store for trainers.

    python -m flows.serve --port 8000 --store_root ./data --follow_runs '[run-1]' --stop_after_steps 100

Same config keys as `run-api` (factory/serve/config.py); the served state is
durable, so running the flow again resumes where the last run stopped.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from factory.config import config_help, wants_help
from factory.serve.cli import load_config
from factory.serve.config import ServeConfig
from tasks.batching import publish_serve_summary_task, serve_batches_task


@flow(name="serve", log_prints=False)
def serve(config: ServeConfig, stop_after_steps: int | None = None, max_runtime_s: float | None = None) -> dict[str, Any]:
    """Serve batches until the trainer reaches `stop_after_steps` (or `max_runtime_s`); returns the final status."""
    logger = get_run_logger()
    logger.info("batching API on %s:%d from %s (following %s)", config.host, config.port, config.store_root,
                config.follow_runs or "posted groups only")
    status = serve_batches_task(config, stop_after_steps=stop_after_steps, max_runtime_s=max_runtime_s)
    logger.info("served %d steps (%d groups); %d groups still queued", status["current_step"], status["served_groups"],
                status["queue_size"])
    return publish_serve_summary_task(status)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if wants_help(args):
        print(config_help(ServeConfig, extra_options=[
            ("--stop_after_steps N", "Stop once the trainer reaches step N (default: serve until stopped)."),
            ("--max_runtime_s S", "Stop after S seconds (default: serve until stopped).")]))
        return
    limits: dict[str, float | None] = {"stop_after_steps": None, "max_runtime_s": None}
    rest = []
    index = 0
    while index < len(args):
        key = args[index].removeprefix("--").split("=", 1)[0]
        if key in limits:
            value = args[index].split("=", 1)[1] if "=" in args[index] else args[index + 1]
            index += 1 if "=" in args[index] else 2
            limits[key] = float(value)
            continue
        rest.append(args[index])
        index += 1
    steps = limits["stop_after_steps"]
    serve(load_config(rest), stop_after_steps=int(steps) if steps is not None else None, max_runtime_s=limits["max_runtime_s"])


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.serve", main))
