"""`sft-export` and `dpo-export`: a run's shards (or a batching API) -> a TRL-ready dataset + a summary artifact.

    python -m flows.export sft --output.path out/sft --source.runs '[run-1]' --select.top_n_per_group 2
    python -m flows.export dpo --config deployments/export.yaml --output.style text --output.tokenizer models/starter-policy
    prefect deployment run sft-export/sft-export --params '{"source": {"runs": ["intern-bootcamp"]}}'

As deployments, the sections a run gives merge key by key into the deployment's (prefect.yaml), and a store that
holds none of the chosen runs fails the run at once with one line.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel

from factory.config import build_config, deployment_defaults, merge_run_parameters, split_config_path, validate_config
from factory.export.config import (
    DpoExportConfig,
    DpoSelectionConfig,
    OutputConfig,
    SelectionConfig,
    SftExportConfig,
    SourceConfig,
)
from factory.export.source import check_store_source
from tasks.export import publish_summary_task, run_export_task


Section = BaseModel | dict[str, Any] | None


def _config(model: type[SftExportConfig] | type[DpoExportConfig], **sections: Section) -> Any:
    """The export config from the flow's sections, each merged key by key into the deployment's own."""
    given = {name: value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else value
             for name, value in sections.items()}
    merged = merge_run_parameters(deployment_defaults(), given)
    return validate_config(model, {name: value for name, value in merged.items() if value is not None},
                           sources=[("the flow parameters", given)])


def _run(config: SftExportConfig | DpoExportConfig, kind: str) -> dict[str, Any]:
    logger = get_run_logger()
    check_store_source(config.source)  # no rows to read: one line now, not a failed task later
    source = config.source.api_url or f"{config.source.store} runs={config.source.runs or 'all'}"
    logger.info("%s export from %s to %s", kind.upper(), source, config.output.path)
    stats = run_export_task(config)
    summary = publish_summary_task(stats, key=f"{kind}-export-summary")
    logger.info("%d groups -> %d rows in %.1f s; dropped %s", stats.groups_in, stats.rows_out, stats.seconds,
                dict(stats.dropped))
    return summary


@flow(name="sft-export", log_prints=False)
def sft_export(output: OutputConfig | dict[str, Any] | None = None,
               source: SourceConfig | dict[str, Any] | None = None,
               select: SelectionConfig | dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the best sequences of each group as SFT rows; returns the summary (also an artifact)."""
    config = _config(SftExportConfig, output=output, source=source, select=select)
    return _run(config, "sft")


@flow(name="dpo-export", log_prints=False)
def dpo_export(output: OutputConfig | dict[str, Any] | None = None,
               source: SourceConfig | dict[str, Any] | None = None,
               select: DpoSelectionConfig | dict[str, Any] | None = None) -> dict[str, Any]:
    """Write chosen/rejected pairs within each group as DPO rows; returns the summary (also an artifact)."""
    config = _config(DpoExportConfig, output=output, source=source, select=select)
    return _run(config, "dpo")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("sft", "dpo"):
        if args and args[0] in ("-h", "--help"):
            print(f"usage: python -m flows.export {{sft|dpo}} [--config FILE] [--KEY VALUE ...]\n\n{__doc__.strip()}\n\n"
                  "`python -m flows.export sft --help` (or dpo) lists every key.")
            return
        raise SystemExit("usage: python -m flows.export {sft|dpo} [--config FILE] [--output.path PATH] [--key value ...]")
    kind, rest = args[0], args[1:]
    yaml_path, overrides = split_config_path(rest)
    model = SftExportConfig if kind == "sft" else DpoExportConfig
    config = build_config(model, yaml_path=yaml_path, cli_args=overrides)
    check_store_source(config.source)  # a missing store or run is refused before a flow run starts
    run = sft_export if kind == "sft" else dpo_export
    summary = run(output=config.output, source=config.source, select=config.select)
    print(f"{summary['rows_out']} rows -> {', '.join(summary['outputs'])}")


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.export", main))
