"""The env scripts' command line, with Atropos's modes: `process`, `evaluate`, `serve`.

    python environments/intern_bootcamp.py process  --config deployments/intern_bootcamp.yaml --env.total_items 16
    python environments/intern_bootcamp.py evaluate --openai.base_url http://127.0.0.1:30000
    python environments/intern_bootcamp.py serve    --serve.api_url http://127.0.0.1:8000

`process` runs the datagen flow with no batching service and then writes the
run's groups as `groups.jsonl` plus a self-contained `groups.html` to read
them. `evaluate` greedy-samples the env's eval items and writes
`metrics.json` and `samples.jsonl`. `serve` runs the flow with backpressure
against the batching API, which serves the shards it commits.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

from environments.base import EnvSpec, load_env
from factory.cli_errors import classify
from factory.config import ConfigError, config_help, prog_name, split_config_path, wants_help
from factory.preflight import PreflightError, preflight
from factory.inference.client import InferenceClient
from factory.datagen.store import open_datagen_store
from factory.store_object import StoreReader, open_store
from factory.datagen.config import JobConfig, build_job_config, job_config_model
from factory.datagen.endpoints import choose_endpoints
from factory.datagen.ops import RunStopped
from tasks.generate import ClientSampler, load_tokenizer, resolve_api

MODES = ("process", "evaluate", "serve")

RunDatagen = Callable[..., Any]
"""flows.datagen.run_datagen (passed in: this module is imported by flows.datagen, never the other way)."""


def output_dir(cfg: JobConfig) -> Path:
    d = cfg.datagen
    # default: the run's directory; for an s3:// store, its local run-files directory
    path = Path(d.output_dir) if d.output_dir else open_datagen_store(d.store_root, d.run_files_dir).run_dir(d.run_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_groups_jsonl(store: StoreReader, run_id: str, path: Path) -> int:
    """Every group of a run as one JSON object per line (Atropos's wire fields plus factory metadata)."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for group in store.iter_groups(run_id):
            out.write(group.model_dump_json() + "\n")
            count += 1
    return count


def write_groups_html(jsonl: Path, path: Path, *, title: str, limit: int = 500) -> None:
    """A single HTML file (CSS inlined, no scripts or external assets) of the groups, drawn with view-run's templates."""
    from factory.viewer.render import render_static_groups

    with open(jsonl, encoding="utf-8") as source:
        total = sum(1 for line in source if line.strip())
    with open(jsonl, encoding="utf-8") as source:
        groups = (json.loads(line) for line in source if line.strip())
        page = render_static_groups(groups, title=title, total=total, limit=limit, source_name=jsonl.name)
    path.write_text(page, encoding="utf-8")


def process(ref: str, cfg: JobConfig, config_path: str | None, args: list[str], run: RunDatagen) -> dict[str, Any]:
    summary = run(ref, config_path=config_path, cli_args=args)
    store = open_store(cfg.datagen.store_root)
    out = output_dir(cfg)
    jsonl = out / "groups.jsonl"
    count = write_groups_jsonl(store, cfg.datagen.run_id, jsonl)
    write_groups_html(jsonl, out / "groups.html", title=f"{cfg.datagen.producer} — run {cfg.datagen.run_id}")
    print(f"wrote {count} groups to {jsonl} and {out / 'groups.html'}")
    return summary


def evaluate(ref: str, cfg: JobConfig) -> dict[str, float]:
    env = load_env(EnvSpec(ref, cfg.env.model_dump(mode="json")))
    api = resolve_api(cfg.datagen.sampling_api, cfg.openai)
    tokenizer = load_tokenizer(cfg.env.tokenizer_name) if cfg.env.tokenizer_name else None

    async def run() -> tuple[dict[str, float], list[dict[str, Any]]]:
        async with InferenceClient(cfg.openai) as client:
            return await env.evaluate(ClientSampler(client, tokenizer, api))

    metrics, samples = asyncio.run(run())
    out = output_dir(cfg)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps(sample, default=str) + "\n")
    print(f"wrote {out / 'metrics.json'} and {out / 'samples.jsonl'}: {json.dumps(metrics)}")
    return metrics


def main(ref: str, argv: list[str] | None = None, *, run: RunDatagen) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in MODES:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: {prog_name()} {{{','.join(MODES)}}} [--config FILE] [--env.KEY VALUE ...]\n\n{__doc__.strip()}"
                  f"\n\n`{prog_name()} process --help` lists every key with its default and description.")
            return 0
        print(f"usage: {Path(sys.argv[0]).name} {{{','.join(MODES)}}} [--config FILE] [--env.KEY VALUE ...]",
              file=sys.stderr)
        return 2
    mode, rest = argv[0], argv[1:]
    # Without PREFECT_API_URL Prefect starts a temporary server; on a busy laptop it needs longer than its default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    config_path, args = split_config_path(rest)
    if wants_help(args):
        print(config_help(job_config_model(ref), usage_args=mode, description=__doc__.strip()))
        return 0
    try:
        cfg = build_job_config(ref, config_path=config_path, cli_args=args)
        choose_endpoints(cfg)  # as the flow does: preflight checks the block's endpoints, not openai.base_url
        if mode == "serve" and not cfg.serve.api_url:
            raise ConfigError("serve mode needs the batching API: set --serve.api_url http://HOST:8000")
        preflight(cfg, mode=mode, wait_s=cfg.datagen.preflight_wait_s)
    except (ConfigError, PreflightError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        if mode == "evaluate":
            evaluate(ref, cfg)
        elif mode == "process":
            process(ref, cfg, config_path, args, run)
        else:
            print(json.dumps(run(ref, config_path=config_path, cli_args=args), indent=2))
    except RunStopped as stopped:
        print(f"error: {stopped}", file=sys.stderr)
        return stopped.code
    except Exception as error:  # the cause is the last line printed, after Prefect's own logs
        from factory.prefect_outage import describe_prefect_outage

        if outage := describe_prefect_outage(error):
            from factory.prefect_outage import exit_with_outage

            exit_with_outage(outage)  # outage hook: the line stays last (no event-worker noise after it)
        known = classify(error)
        print(f"error: {known[1] if known else f'{type(error).__name__}: {error}'}", file=sys.stderr)
        return known[0] if known else 1
    return 0
