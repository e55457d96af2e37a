"""Prefect tasks of the batching flow: one long-running task serves the API, one publishes what it served."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from factory.serve.cli import run_service
from factory.serve.config import ServeConfig


def serve_batches(config: ServeConfig, stop_after_steps: int | None = None, max_runtime_s: float | None = None) -> dict[str, Any]:
    """Run the Atropos-compatible batching API until the trainer reaches `stop_after_steps` or time runs out."""
    return run_service(config, stop_after_steps=stop_after_steps, max_runtime_s=max_runtime_s)


def publish_serve_summary(status: dict[str, Any], key: str = "batching-api-summary") -> dict[str, Any]:
    """Record steps served, groups served/skipped and what is left queued as a markdown artifact."""
    rows = "\n".join(f"| {name} | {value} |" for name, value in status.items())
    create_markdown_artifact(key=key, markdown=f"| metric | value |\n|---|---|\n{rows}\n", description="Batching API run")
    return status


# No retries: the served state is durable, so rerunning the flow resumes; a
# retry inside the same flow run would only hide a port or config error.
serve_batches_task = task(serve_batches, name="serve-batches", task_run_name="serve-batches-{config.port}", retries=0)
publish_serve_summary_task = task(publish_serve_summary, name="publish-serve-summary", retries=2, retry_delay_seconds=2)
