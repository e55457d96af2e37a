"""`atropos-sft-gen` and `atropos-dpo-gen`: Atropos's export CLIs, reading the shard store by default.

The flags keep Atropos's names and meanings; what differs, and why:
- the source is the shard store (`--store`, `--run`, `--env`) unless `--api-url`
  is given, in which case the CLI registers with that batching API and reads
  GET /batch as Atropos does (without Atropos's /reset_data unless
  `--reset-api`, since that drops data queued by environments), and asks for
  batches as Arrow streams, which a factory run-api sends (`--api-json` asks
  for JSON; Atropos's run-api always answers JSON, which is read as such);
- `--num-seqs-to-save` defaults to everything in the store (100 with --api-url,
  as Atropos), and the output holds exactly that many rows;
- rows are TRL-ready: `--save-messages` writes message lists; without it rows
  are text rendered with `--tokenizer`'s chat template (message lists when no
  tokenizer is given);
- a path ending in .jsonl or .parquet is one file, any other path a directory
  of Parquet shards; `--append-to-previous` / `--overwrite` as Atropos refuses
  to overwrite otherwise;
- `--keep-images` writes multimodal sequences in TRL's vision layout (image
  placeholders in messages, an `images` column of the pictures' bytes);
  without it they are left out and counted as `multimodal_needs_output_images`;
- `--max-token-len` also drops longer sequences; `--group-size` only sizes
  the /register batch, as in Atropos.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from typing import Any

from pydantic import ValidationError

from factory.cli_errors import run_cli
from factory.export.config import (
    DpoExportConfig,
    DpoSelectionConfig,
    OutputConfig,
    SelectionConfig,
    SftExportConfig,
    SourceConfig,
)
from factory.export.render import RenderError
from factory.export.source import SourceError
from factory.export.stats import ExportStats
from factory.export.writer import OutputExistsError


def _parser(kind: str) -> argparse.ArgumentParser:
    what = "SFT rows" if kind == "sft" else "DPO pairs"
    parser = argparse.ArgumentParser(
        prog=f"atropos-{kind}-gen", description=f"Write {what} from the factory's shard store or a batching API."
    )
    add = parser.add_argument
    add("filepath", help="Output: a .jsonl or .parquet file, or a directory of Parquet shards.")
    add("--store", default="./data", help="Shard store root (default ./data).")
    add("--run", dest="runs", action="append", default=[], help="Run to read (repeatable; default: every run).")
    add("--env", dest="envs", action="append", default=[], help="Environment to keep (repeatable; default: all).")
    add("--api-url", default=None, help="Read from this Atropos-compatible batching API instead of the store.")
    add("--group-size", type=int, default=2, help="Group size sent on /register with --api-url.")
    add("--tasks-per-step", type=int, default=64, help="Groups per step sent on /register with --api-url.")
    add("--max-token-len", type=int, default=None, help="Drop longer sequences (and send it on /register; 2048 if unset).")
    add("--api-idle-timeout", type=float, default=60.0, help="With --api-url: stop after this many seconds without a batch.")
    add("--reset-api", action="store_true", help="With --api-url: GET /reset_data first, as Atropos does.")
    add("--api-json", action="store_true",
        help="With --api-url: ask for JSON batches (default: an Arrow stream, which a factory run-api sends).")
    add("--tokenizer", default=None, help="Tokenizer dir or hub id: rows become chat-template text.")
    add("--save-messages", action="store_true", help="Write message lists even when --tokenizer is given.")
    if kind == "sft":
        add("--save-top-n-per-group", type=int, default=3, help="Most sequences kept per group, best first.")
        add("--prompt-completion", action="store_true", help="Write prompt/completion columns instead of messages/text.")
    else:
        add("--save-n-pairs-per-group", type=int, default=3, help="Most pairs per group.")
        add("--seed", type=int, default=0, help="Seed of the random pick among eligible rejected.")
    add("--num-seqs-to-save", type=int, default=None, help="Rows to write (default: all; 100 with --api-url).")
    add("--allow-negative-scores", action="store_true", help="Also keep sequences scoring <= 0.")
    default_diff = 0.0 if kind == "sft" else 0.5
    diff_help = (
        "Keep sequences scoring more than this above the group minimum."
        if kind == "sft"
        else "A rejected must score more than this below its chosen."
    )
    add("--minimum-score-diff-max-min", type=float, default=default_diff, help=diff_help)
    add("--min-score", type=float, default=None, help="Keep only sequences scoring at least this.")
    add("--no-dedup", action="store_true", help="Keep rows whose content was already written.")
    add("--append-to-previous", action="store_true", help="Add to an existing output.")
    add("--overwrite", action="store_true", help="Replace an existing output.")
    add("--format", choices=["parquet", "jsonl"], default=None, help="Format of a directory output (default parquet).")
    add("--keep-images", action="store_true",
        help="Keep multimodal sequences: image placeholders in messages and an images column (Parquet).")
    add("--no-extra-columns", action="store_true", help="Write only the TRL columns (no score, group_id, env, ...).")
    add("--prefect", action="store_true", help="Run as the Prefect flow (records a summary artifact).")
    add("--quiet", action="store_true", help="Print only the final summary line.")
    return parser


def build_export_config(kind: str, args: argparse.Namespace) -> SftExportConfig | DpoExportConfig:
    """The export config an Atropos-style command line describes."""
    limit = args.num_seqs_to_save
    if limit is None and args.api_url:
        limit = 100
    source = SourceConfig(
        store=args.store,
        runs=args.runs,
        envs=args.envs,
        api_url=args.api_url,
        api_group_size=args.group_size,
        api_tasks_per_step=args.tasks_per_step,
        api_max_token_len=args.max_token_len or 2048,
        api_idle_timeout_s=args.api_idle_timeout,
        api_reset_first=args.reset_api,
        api_arrow=not args.api_json,
    )
    text = bool(args.tokenizer) and not args.save_messages and not args.keep_images
    output = OutputConfig(
        path=args.filepath,
        format=args.format,
        style="text" if text else "conversational",
        prompt_completion=getattr(args, "prompt_completion", False),
        tokenizer=args.tokenizer,
        extra_columns=not args.no_extra_columns,
        images=args.keep_images,
        overwrite=args.overwrite,
        append=args.append_to_previous,
    )
    common: dict[str, Any] = {
        "min_score": args.min_score,
        "allow_negative_scores": args.allow_negative_scores,
        "min_score_diff_max_min": args.minimum_score_diff_max_min,
        "max_token_len": args.max_token_len,
        "dedup": not args.no_dedup,
        "limit": limit,
    }
    if kind == "sft":
        select = SelectionConfig(top_n_per_group=args.save_top_n_per_group, **common)
        return SftExportConfig(source=source, select=select, output=output)
    select = DpoSelectionConfig(pairs_per_group=args.save_n_pairs_per_group, seed=args.seed, **common)
    return DpoExportConfig(source=source, select=select, output=output)


def _run(kind: str, config: SftExportConfig | DpoExportConfig, use_prefect: bool, quiet: bool) -> dict[str, Any]:
    if use_prefect:
        from flows.export import dpo_export, sft_export

        run = sft_export if kind == "sft" else dpo_export
        return run(output=config.output, source=config.source, select=config.select)
    from factory.export.pipeline import export_dpo, export_sft

    def progress(stats: ExportStats) -> None:
        if not quiet:
            print(f"  {stats.groups_in} groups read, {stats.rows_out} rows written", file=sys.stderr)

    export = export_sft if kind == "sft" else export_dpo
    # The objects made so far (modules, classes, configs) live as long as this one-shot process: left out of the
    # collector's full passes, which otherwise walk them again and again while rows are made.
    gc.freeze()
    return export(config, progress=progress).to_dict()  # type: ignore[arg-type]


def main(kind: str, argv: list[str] | None = None) -> int:
    args = _parser(kind).parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = build_export_config(kind, args)
        summary = _run(kind, config, args.prefect, args.quiet)
    except ValidationError as error:
        print(f"atropos-{kind}-gen: invalid options: {error}", file=sys.stderr)
        return 2
    except (OutputExistsError, SourceError, RenderError, ValueError) as error:
        print(f"atropos-{kind}-gen: {error}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("score_histogram")}, indent=1),
              file=sys.stderr)
    unit = "pairs" if kind == "dpo" else "rows"
    print(f"wrote {summary['rows_out']} {unit} from {summary['groups_in']} groups to {', '.join(summary['outputs'])}")
    if summary["rows_out"] == 0:  # a script must be able to tell an empty dataset from a written one
        print(f"atropos-{kind}-gen: error: no {unit} matched ({summary['groups_in']} groups read, dropped "
              f"{summary.get('dropped') or {}}): check --run/--env/--store, or loosen --min-score and "
              "--minimum-score-diff-max-min", file=sys.stderr)
        return 1
    return 0


def sft_main() -> None:
    raise SystemExit(run_cli("atropos-sft-gen", lambda args: main("sft", args)))


def dpo_main() -> None:
    raise SystemExit(run_cli("atropos-dpo-gen", lambda args: main("dpo", args)))
