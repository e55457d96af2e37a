"""`atropos-sft-gen` and `atropos-dpo-gen`: atroposlib 0.4.0's export CLIs, flag for flag, line for line.

Atropos's flags keep their names and defaults (`--api-url http://localhost:8000`,
`--num-seqs-to-save 100`, `--tokenizer NousResearch/DeepHermes-3-Llama-3-8B-Preview`,
...), and so does what the CLI does with them: GET /reset_data, POST /register
with Atropos's body (printing both answers), then GET /batch every second; rows in
Atropos's line layout (see factory/export/atropos.py) to one JSON lines file,
refused if it exists unless `--append-to-previous`. What differs, on purpose:
- it exits as soon as `--num-seqs-to-save` rows are written (Atropos writes the
  rest of the batch that crossed the limit, so its file can hold more);
- the tokenizer is loaded only when rows are decoded text (not for
  `--save-messages`), and a path that exists is refused before /reset_data,
  not after it; a local tokenizer dir's decoder is saved after its first load
  through transformers and read without transformers on later runs
  (factory/export/decode_cache.py; `FACTORY_DECODE_CACHE=off` turns it off);
- bad input ends the run with one line on stderr and a non-zero exit, not a
  traceback.

Factory options, all off by default: `--store`/`--run`/`--env` read the shard
store instead of an API; `--layout trl` writes TRL-ready rows (Parquet or JSONL,
`--format`, `--keep-images`, `--prompt-completion`, `--no-extra-columns`);
`--dedup`, `--min-score`, `--max-token-len-filter`, `--seed`, `--no-reset`,
`--api-idle-timeout`, `--api-json`, `--overwrite`, `--prefect`, `--quiet`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from typing import Any

if "httpx" not in sys.modules:
    # httpx imports its own command-line client (rich, click, pygments: ~80 ms) when those are installed; this
    # one-shot CLI never uses it, and without it httpx falls back to a stub.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

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
from factory.export.pipeline import NoRowsError
from factory.export.source import SourceError
from factory.export.stats import ExportStats
from factory.export.writer import OutputExistsError


ATROPOS_API_URL = "http://localhost:8000"
ATROPOS_TOKENIZER = "NousResearch/DeepHermes-3-Llama-3-8B-Preview"


def _parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"atropos-{kind}-gen",
        description=f"Grab {kind.upper()} data from an Atropos API instance (or, with --store/--run, the shard store).",
    )
    add = parser.add_argument
    # ---- atroposlib 0.4.0's flags, names and defaults ----
    add("filepath", help="Path to the output JSONL file (with --layout trl: .jsonl, .parquet or a directory).")
    add("--api-url", default=ATROPOS_API_URL, help=f"Base URL of the batching API (default {ATROPOS_API_URL}).")
    add("--group-size", type=int, default=2, help="Sequences per group; sizes the batch sent on /register.")
    add("--max-token-len", type=int, default=2048, help="max_token_len sent on /register.")
    add("--tokenizer", default=ATROPOS_TOKENIZER,
        help="Tokenizer dir or hub id that decodes tokens to text (not loaded with --save-messages).")
    add("--save-messages", action="store_true", help="Save message lists instead of decoded text completions.")
    if kind == "sft":
        add("--save-top-n-per-group", type=int, default=3, help="Most highest-scoring sequences saved per group.")
    else:
        add("--save-n-pairs-per-group", type=int, default=3, help="Most pairs saved per group.")
    add("--num-seqs-to-save", type=int, default=None,
        help="Rows to write, then exit (default 100; with --store/--run: all).")
    add("--allow-negative-scores", action="store_true", help="Also save sequences scoring <= 0.")
    add("--minimum-score-diff-max-min", type=float, default=0.0 if kind == "sft" else 0.5,
        help="SFT: keep sequences scoring more than this above the group minimum. DPO: a rejected must score more "
        "than this below its chosen.")
    add("--append-to-previous", action="store_true", help="Append to an existing output instead of refusing it.")
    if kind == "sft":
        add("--tasks-per-step", type=int, default=64, help="Groups per step: /register's batch_size is group_size x this.")
    # ---- factory options (off by default) ----
    extra = parser.add_argument_group("factory options")
    add = extra.add_argument
    add("--store", default=None, help="Read this shard store (a directory or s3://bucket/prefix) instead of the API (default ./data with --run).")
    add("--run", dest="runs", action="append", default=[], help="Store run to read (repeatable); implies the store.")
    add("--env", dest="envs", action="append", default=[], help="Environment to keep (repeatable; default: all).")
    add("--layout", choices=["atropos", "trl"], default=None,
        help="atropos: Atropos's JSON lines (default). trl: TRL-ready rows (Parquet or JSONL, extra columns; the "
        "default when a TRL-only option below is given).")
    add("--dedup", action="store_true", help="Drop rows whose content was already written (after the top-n pick).")
    add("--min-score", type=float, default=None, help="Keep only sequences scoring at least this.")
    add("--max-token-len-filter", type=int, default=None, help="Drop sequences longer than this many tokens.")
    add("--no-reset", action="store_true", help="Skip GET /reset_data (which drops data the API has queued).")
    add("--api-idle-timeout", type=float, default=None,
        help="Stop after this many seconds without a batch (default: poll until the rows are written, as Atropos).")
    add("--api-json", action="store_true", help="Ask for JSON batches (default: Arrow, which a factory run-api sends).")
    add("--overwrite", action="store_true", help="Replace an existing output.")
    add("--format", choices=["parquet", "jsonl"], default=None, help="--layout trl: format of a directory output.")
    add("--keep-images", action="store_true", help="--layout trl: TRL's vision layout (Parquet).")
    add("--no-extra-columns", action="store_true", help="--layout trl: only the TRL columns.")
    if kind == "sft":
        add("--prompt-completion", action="store_true", help="--layout trl: prompt/completion columns.")
    else:
        add("--seed", type=int, default=0, help="Seed of the random pick among eligible rejected.")
    add("--prefect", action="store_true", help="Run as the Prefect flow (records a summary artifact).")
    add("--quiet", action="store_true", help="Print only the final summary line.")
    return parser


def build_export_config(kind: str, args: argparse.Namespace) -> SftExportConfig | DpoExportConfig:
    """The export config an Atropos-style command line describes."""
    from_store = args.store is not None or bool(args.runs)
    limit = args.num_seqs_to_save
    if limit is None and not from_store:
        limit = 100
    tasks_per_step = args.tasks_per_step if kind == "sft" else 8  # Atropos's dpo-gen registers group_size * 8
    source = SourceConfig(
        store=args.store or "./data",
        runs=args.runs,
        envs=args.envs,
        api_url=None if from_store else args.api_url,
        api_group_size=args.group_size,
        api_tasks_per_step=tasks_per_step,
        api_max_token_len=args.max_token_len,
        api_num_steps=0 if kind == "sft" else 2 * (limit or 0),  # what Atropos's CLIs send
        api_idle_timeout_s=args.api_idle_timeout,
        api_reset_first=not args.no_reset,
        api_print_responses=not args.quiet,
        api_arrow=not args.api_json,
    )
    trl_only = args.format or args.keep_images or args.no_extra_columns or getattr(args, "prompt_completion", False)
    layout = args.layout or ("trl" if trl_only else "atropos")
    atropos = layout == "atropos"
    if atropos:
        text = not args.save_messages
    else:
        text = bool(args.tokenizer) and args.tokenizer != ATROPOS_TOKENIZER and not args.save_messages \
            and not args.keep_images
    output = OutputConfig(
        path=args.filepath,
        layout=layout,
        format=args.format,
        style="text" if text else "conversational",
        prompt_completion=getattr(args, "prompt_completion", False),
        tokenizer=args.tokenizer if text else None,
        extra_columns=not args.no_extra_columns,
        images=args.keep_images,
        overwrite=args.overwrite,
        append=args.append_to_previous,
    )
    common: dict[str, Any] = {
        "min_score": args.min_score,
        "allow_negative_scores": args.allow_negative_scores,
        "min_score_diff_max_min": args.minimum_score_diff_max_min,
        "max_token_len": args.max_token_len_filter,
        "dedup": args.dedup,
        "limit": limit,
    }
    if kind == "sft":
        select = SelectionConfig(top_n_per_group=args.save_top_n_per_group, **common)
        return SftExportConfig(source=source, select=select, output=output)
    select = DpoSelectionConfig(pairs_per_group=args.save_n_pairs_per_group, seed=args.seed, **common)
    return DpoExportConfig(source=source, select=select, output=output)


def _import_httpcore() -> None:
    """Import httpcore (which the API source's httpx client loads when it is made) without trio and h2 (~0.1 s of
    this CLI's start-up): it imports them when installed, for async use under trio and for HTTP/2, and the CLI's
    one client is synchronous HTTP/1.1. Only this import goes without them; they import as usual afterwards."""
    from factory.export.atropos import imports_failing  # noqa: PLC0415

    with imports_failing("trio", "h2"):
        import httpcore  # noqa: F401, PLC0415


def _run(kind: str, config: SftExportConfig | DpoExportConfig, use_prefect: bool, quiet: bool) -> dict[str, Any]:
    if use_prefect:
        from flows.export import dpo_export, sft_export

        run = sft_export if kind == "sft" else dpo_export
        return run(output=config.output, source=config.source, select=config.select)
    from factory.export.pipeline import export_dpo, export_sft  # noqa: PLC0415

    if config.source.api_url:
        _import_httpcore()

    def progress(stats: ExportStats) -> None:
        if not quiet:
            print(f"  {stats.groups_in} groups read, {stats.rows_out} rows written", file=sys.stderr)

    export = export_sft if kind == "sft" else export_dpo
    # The objects made so far (modules, classes, configs) live as long as this one-shot process: left out of the
    # collector's full passes, which otherwise walk them again and again while rows are made.
    gc.freeze()
    return export(config, progress=progress, require_rows=True).to_dict()  # type: ignore[arg-type]


def main(kind: str, argv: list[str] | None = None) -> int:
    args = _parser(kind).parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = build_export_config(kind, args)
        summary = _run(kind, config, args.prefect, args.quiet)
    except ValidationError as error:
        problems = "; ".join(":".join([*map(str, e["loc"]), e["msg"]]) for e in error.errors())
        print(f"atropos-{kind}-gen: invalid options: {problems}", file=sys.stderr)
        return 2
    except (OutputExistsError, SourceError, NoRowsError, ValueError) as error:  # ValueError: RenderError, AtroposLayout...
        print(f"atropos-{kind}-gen: {' '.join(str(error).split())}", file=sys.stderr)  # one line
        return 1
    if not args.quiet:
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("score_histogram")}, indent=1),
              file=sys.stderr)
    unit = "pairs" if kind == "dpo" else "rows"
    print(f"wrote {summary['rows_out']} {unit} from {summary['groups_in']} groups to {', '.join(summary['outputs'])}",
          file=sys.stderr)  # stdout carries only what Atropos's CLI prints there (the /reset_data and /register answers)
    return 0


def sft_main() -> None:
    raise SystemExit(run_cli("atropos-sft-gen", lambda args: main("sft", args)))


def dpo_main() -> None:
    raise SystemExit(run_cli("atropos-dpo-gen", lambda args: main("dpo", args)))
