"""Prefect tasks of the export flows: one coarse task runs the streaming export, one publishes its summary."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from factory.export.config import DpoExportConfig, SftExportConfig
from factory.export.pipeline import export_dpo, export_sft
from factory.export.stats import ExportStats


def run_export(config: SftExportConfig | DpoExportConfig) -> ExportStats:
    """Run the whole export in one pass (a single streaming pass keeps dedup and the row limit exact)."""
    if isinstance(config, DpoExportConfig):
        return export_dpo(config)
    return export_sft(config)


def publish_summary(stats: ExportStats, key: str) -> dict[str, Any]:
    """Record rows in/out, drops by reason and the score histogram as a Prefect markdown artifact."""
    create_markdown_artifact(key=key, markdown=stats.markdown(), description=f"{stats.kind.upper()} export summary")
    return stats.to_dict()


# No retries on the export itself: a failed attempt publishes nothing, but it
# is usually a config or data error that a retry would only repeat.
run_export_task = task(run_export, name="run-export", task_run_name="export-{config.output.path}", retries=0)
publish_summary_task = task(publish_summary, name="publish-export-summary", retries=2, retry_delay_seconds=2)
