"""The export itself: groups in, selected and rendered rows out, one pass, memory flat in the input.

`export_sft` and `export_dpo` are the plain functions behind the Prefect
flows and the CLIs. They read groups as a stream (see `source`), select
(`select`), render (`render`, or `atropos` for Atropos's own line layout),
drop duplicates by content hash only when `select.dedup` asks (after the
top-n pick), and write through a crash-safe `DatasetWriter` (Atropos's
layout: `JsonLinesWriter`); on any error the partial output is discarded and
the previous output, if any, is left as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from factory.export import select as rules
from factory.export.atropos import AtroposRenderer, JsonLinesWriter, TokenizerLoader
from factory.export.config import DpoExportConfig, SftExportConfig
from factory.export.select import MULTIMODAL_SKIPPED
from factory.export.source import ExportGroup, iter_groups
from factory.export.stats import DedupSet, ExportStats
from factory.export.writer import DatasetWriter

if TYPE_CHECKING:
    from factory.export.render import Renderer  # TRL rows: imported when written (pyarrow), not on Atropos's path

logger = logging.getLogger(__name__)

Progress = Callable[[ExportStats], None]


class NoRowsError(RuntimeError):
    """The export matched no rows (and the caller asked for at least one); the message says what was read and dropped."""


def _renderer(kind: str, config: SftExportConfig | DpoExportConfig, tokenizer: Any | None) -> Renderer | AtroposRenderer:
    if config.output.layout == "atropos":
        if tokenizer is None and config.output.style == "text":
            tokenizer = TokenizerLoader(config.output.tokenizer or "")
        return AtroposRenderer(kind, config.output, tokenizer)
    from factory.export.render import Renderer, load_tokenizer

    if tokenizer is None and config.output.style == "text":
        tokenizer = load_tokenizer(config.output.tokenizer or "")
    return Renderer(kind, config.output, tokenizer)


def _sft_rows(
    groups: Iterable[ExportGroup], config: SftExportConfig, renderer: Renderer, stats: ExportStats
) -> Iterator[dict[str, Any]]:
    select = config.select
    seen = DedupSet() if select.dedup else None
    for group in groups:
        stats.groups_in += 1
        stats.rows_in += len(group.scores)
        stats.scores_in.add(group.scores)
        ranked, dropped = rules.rank_sft(group.scores, group.seq_lens, group.completion_lens, select)
        stats.dropped.update(dropped)
        taken = 0
        for position, index in enumerate(ranked):
            if taken == select.top_n_per_group:
                stats.dropped[rules.TOP_N] += len(ranked) - position
                break
            row = renderer.sft_row(group, index)
            if row is None:
                stats.dropped[renderer.drop_reason or rules.UNRENDERABLE] += 1
                continue
            taken += 1  # the top n are picked first; a duplicate among them is dropped, not replaced by a lower rank
            if seen is not None and not seen.add(renderer.content_hash(row)):
                stats.dropped[rules.DUPLICATE] += 1
                continue
            stats.scores_out.add_one(group.scores[index])
            yield row


def _dpo_rows(
    groups: Iterable[ExportGroup], config: DpoExportConfig, renderer: Renderer, stats: ExportStats
) -> Iterator[dict[str, Any]]:
    select = config.select
    seen = DedupSet() if select.dedup else None
    for group in groups:
        stats.groups_in += 1
        stats.rows_in += len(group.scores)
        stats.scores_in.add(group.scores)
        pairs, dropped = rules.pair_dpo(group.scores, group.seq_lens, group.completion_lens, select, group.group_id)
        stats.dropped.update(dropped)
        for pair in pairs:
            row = renderer.dpo_row(group, pair)
            if row is None:
                stats.dropped[renderer.drop_reason or rules.UNRENDERABLE] += 2
                continue
            if seen is not None and not seen.add(renderer.content_hash(row)):
                stats.dropped[rules.DUPLICATE] += 2
                continue
            stats.scores_out.add([group.scores[pair.chosen], group.scores[pair.rejected]])
            yield row


def _run(
    kind: str,
    config: SftExportConfig | DpoExportConfig,
    rows: Callable[..., Iterator[dict[str, Any]]],
    groups: Iterable[ExportGroup] | None,
    tokenizer: Any | None,
    progress: Progress | None,
    progress_every_s: float,
    require_rows: bool,
) -> ExportStats:
    started = time.perf_counter()
    stats = ExportStats(kind=kind)
    renderer = _renderer(kind, config, tokenizer)
    if isinstance(renderer, AtroposRenderer):
        writer: DatasetWriter | JsonLinesWriter = JsonLinesWriter(config.output)
    else:
        writer = DatasetWriter(config.output, renderer.schema())
    limit = config.select.limit
    select = config.select
    need_tokens = select.max_token_len is not None or select.min_completion_tokens > 0 or config.output.style == "text"
    on_idle = renderer.check if isinstance(renderer, AtroposRenderer) else None
    source = iter_groups(config.source, need_tokens=need_tokens, on_idle=on_idle) if groups is None else groups
    last_report = started
    try:
        for row in rows(source, config, renderer, stats):
            writer.write(row)
            stats.rows_out += 1
            if limit is not None and stats.rows_out >= limit:
                break
            if progress is not None and time.perf_counter() - last_report > progress_every_s:
                last_report = time.perf_counter()
                stats.seconds = last_report - started
                progress(stats)
        if require_rows and not stats.rows_out:
            raise NoRowsError(
                f"no rows matched: {stats.groups_in} groups ({stats.rows_in} sequences) read, dropped by reason: "
                f"{dict(stats.dropped) or 'none'}; nothing was written (check --store/--run/--env or --api-url, or loosen "
                "--min-score / --minimum-score-diff-max-min)"
            )
        stats.outputs = [str(p) for p in writer.close()]
    except BaseException:
        writer.abort()
        raise
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    stats.seconds = time.perf_counter() - started
    if stats.dropped[MULTIMODAL_SKIPPED]:
        logger.warning("%d multimodal sequences (with images) left out of the %s export: set output.images "
                       "(--keep-images) to write them in TRL's vision layout", stats.dropped[MULTIMODAL_SKIPPED], kind)
    logger.info("%s export: %d groups, %d sequences in, %d rows out in %.1f s (dropped: %s)", kind, stats.groups_in,
                stats.rows_in, stats.rows_out, stats.seconds, dict(stats.dropped))
    return stats


def export_sft(
    config: SftExportConfig,
    *,
    groups: Iterable[ExportGroup] | None = None,
    tokenizer: Any | None = None,
    progress: Progress | None = None,
    progress_every_s: float = 5.0,
    require_rows: bool = False,
) -> ExportStats:
    """Write the SFT dataset `config` describes; `groups` replaces the configured source (tests, notebooks).

    With `require_rows`, an export that matches no rows raises `NoRowsError` and writes nothing.
    """
    return _run("sft", config, _sft_rows, groups, tokenizer, progress, progress_every_s, require_rows)


def export_dpo(
    config: DpoExportConfig,
    *,
    groups: Iterable[ExportGroup] | None = None,
    tokenizer: Any | None = None,
    progress: Progress | None = None,
    progress_every_s: float = 5.0,
    require_rows: bool = False,
) -> ExportStats:
    """Write the DPO dataset `config` describes; `groups` replaces the configured source (tests, notebooks).

    With `require_rows`, an export that matches no rows raises `NoRowsError` and writes nothing.
    """
    return _run("dpo", config, _dpo_rows, groups, tokenizer, progress, progress_every_s, require_rows)
