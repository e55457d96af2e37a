"""The datagen run's per-chunk stats: one small file per committed chunk, folded into write-once segments.

A datagen flow writes `stats-<producer>-<chunk:08d>.json` before it commits each chunk's shard (the stats of a
chunk whose commit failed are removed again). A day of a hundred workers leaves ~10^6 of them in one run
directory, and every reader (the viewer's drop counts, the run summary, a resume's curriculum replay) would walk
them all. So the producer's only writer folds them (`Folder`, owned by `DatagenRun`): once `FOLD_CHUNKS`
committed chunks sit in per-chunk files, it writes one segment, `stats-<producer>.chunks-<first:08d>-<last:08d>.json`,
atomically and write-once (an object store's run files get no append), and only then deletes the files it holds.
A segment holds, by chunk, each file's text verbatim (`chunks`, parsed only by a resume), what the viewer shows
(`view`: kept, drops, flow run) and the chunks' `totals` (what the summary adds up).

A kill between the two leaves a chunk both in a segment and as a file, with identical content: the readers here
(`iter_stats`, `Restore`, `read_all`, `summed`) and the viewer count it once (the segment's copy), and the writer's
next fold deletes the leftover files. A run written before folding (per-chunk files only) reads as before.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from factory.gc_pause import gc_paused

logger = logging.getLogger(__name__)

FOLD_CHUNKS = 256
"""Fold a producer's per-chunk stats files into one segment once this many committed chunks are unfolded."""

SEGMENT_VERSION = 1

CHUNK_FILE = re.compile(r"^stats-(?P<producer>.+)-(?P<chunk>\d{8})\.json$")
SEGMENT = re.compile(r"^stats-(?P<producer>.+)\.chunks-(?P<first>\d{8})-(?P<last>\d{8})\.json$")
RUN_SUMMARY = re.compile(r"^stats-(?P<producer>.+)\.json$")
"""The producer's run summary (`stats-<producer>.json`); match it after CHUNK_FILE and SEGMENT, which it also covers."""

TOTAL_KEYS = ("groups_kept", "rollouts", "completion_tokens", "scored", "items", "trimmed_over_target")


def chunk_stats_name(producer: str, chunk: int) -> str:
    return f"stats-{producer}-{chunk:08d}.json"


def segment_name(producer: str, first: int, last: int) -> str:
    return f"stats-{producer}.chunks-{first:08d}-{last:08d}.json"


def parse_name(name: str) -> tuple[str, str, int] | None:
    """("segment", producer, first chunk) or ("chunk", producer, chunk) or ("run", producer, -1) for a stats file
    name; None for any other name."""
    if match := SEGMENT.match(name):
        return "segment", match["producer"], int(match["first"])
    if match := CHUNK_FILE.match(name):
        return "chunk", match["producer"], int(match["chunk"])
    if match := RUN_SUMMARY.match(name):
        return "run", match["producer"], -1
    return None


VIEW_KEYS = ("groups_kept", "dropped", "flow_run_id")
"""What the viewer reads of a chunk's stats (drops and flow runs); a segment holds them apart, for cheap reading."""

SUMMED_KEYS = ("groups_kept", "rollouts", "completion_tokens", "scored")
"""What the run's summary adds up over chunks, with `dropped` by reason and `score_sum` (in thousandths, rounded per
chunk)."""


def segment_chunks(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A segment's chunk -> stats (each held as its file's text, parsed here: readers that need less read less)."""
    return {int(chunk): json.loads(text) if isinstance(text, str) else text
            for chunk, text in (data.get("chunks") or {}).items()}


def segment_view(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A segment's chunk -> the VIEW_KEYS of its stats, without parsing the chunks' stats."""
    if "view" in data:
        return {int(chunk): view for chunk, view in data["view"].items()}
    return {chunk: {key: stats[key] for key in VIEW_KEYS if key in stats}
            for chunk, stats in segment_chunks(data).items()}


def totals(chunks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What a segment's chunks add up to: the counts, drops by reason, score sum and chunks by flow run."""
    out: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    flow_runs: Counter[str] = Counter()
    score_sum, score_sum_milli = 0.0, 0
    for stats in chunks.values():
        for key in TOTAL_KEYS:
            out[key] += int(stats.get(key) or 0)
        dropped.update({reason: int(count) for reason, count in (stats.get("dropped") or {}).items()})
        score_sum += float(stats.get("score_sum") or 0.0)
        score_sum_milli += round(float(stats.get("score_sum") or 0.0) * 1000)
        if run := stats.get("flow_run_id"):
            flow_runs[str(run)] += 1
    return {"chunks": len(chunks), **{key: out[key] for key in TOTAL_KEYS}, "score_sum": score_sum,
            "score_sum_milli": score_sum_milli, "dropped": dict(dropped), "flow_runs": dict(flow_runs)}


Listing = tuple[list[tuple[str, str]], dict[tuple[str, int], str]]
"""A run's segments as (name, producer) and per-chunk files as (producer, chunk) -> name."""


def listing(run_dir: Path | str, producer: str | None = None) -> Listing:
    """The run's stats files of one producer (or all): its segments as (name, producer), and its per-chunk files as
    (producer, chunk) -> name (folded or not)."""
    try:
        entries = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return [], {}
    segments, files = [], {}
    for name in entries:
        parsed = parse_name(name)
        if parsed is None or (producer is not None and parsed[1] != producer):
            continue
        kind, owner, chunk = parsed
        if kind == "segment":
            segments.append((name, owner))
        elif kind == "chunk":
            files[(owner, chunk)] = name
    return segments, files


def iter_stats(run_dir: Path | str, producer: str | None = None,
               found: Listing | None = None) -> Iterator[tuple[str, int, dict[str, Any], bool]]:
    """(producer, chunk, stats, from a segment) for every chunk of the run (of one producer, or all), one segment or
    file at a time: segments first, then the per-chunk files no segment holds (a chunk in both counts once).

    A file or segment that cannot be parsed raises, as a stats file did before folding: a resume never silently
    forgets a chunk's curriculum outcomes. (The viewer reads on its own and skips what it cannot parse.)"""
    segments, files = found if found is not None else listing(run_dir, producer)
    run_dir = Path(run_dir)
    folded: set[tuple[str, int]] = set()
    for name, owner in segments:
        for chunk, stats in segment_chunks(json.loads((run_dir / name).read_text(encoding="utf-8"))).items():
            folded.add((owner, chunk))
            yield owner, chunk, stats, True
    for (owner, chunk), name in files.items():
        if (owner, chunk) in folded:
            continue  # a kill came between its segment's write and its file's deletion
        try:
            stats = json.loads((run_dir / name).read_text(encoding="utf-8"))
        except FileNotFoundError:  # folded and deleted since the listing
            continue
        yield owner, chunk, stats, False


class Restore:
    """One producer's chunk stats, streamed once in `for chunk, stats in restore` (a resume's replay), remembering
    on the way what the writer's `Folder` starts from: the per-chunk files, the chunks segments hold, and the stats
    of the chunks only in files (at most a segment's worth, unless the run predates folding)."""

    def __init__(self, run_dir: Path | str, producer: str) -> None:
        self.run_dir, self.producer = run_dir, producer
        self.found = listing(run_dir, producer)
        self.files = {chunk: name for (_, chunk), name in self.found[1].items()}
        """chunk -> per-chunk file name, for every per-chunk file present (folded or not)."""
        self.folded: set[int] = set()
        self.unfolded: dict[int, dict[str, Any]] = {}
        self.done = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        if self.done:
            raise RuntimeError("a Restore is read once")
        for _, chunk, stats, from_segment in iter_stats(self.run_dir, self.producer, self.found):
            if from_segment:
                self.folded.add(chunk)
            else:
                self.unfolded[chunk] = stats
            yield chunk, stats
        self.done = True

    def finish(self) -> Restore:
        """Read what was not read yet (nothing after a full replay)."""
        if not self.done:
            for _ in self:
                pass
        return self


def summed(run_dir: Path | str, producer: str, committed: set[int]) -> tuple[Counter[str], Counter[str]]:
    """SUMMED_KEYS and `score_sum_milli` added up over the committed chunks of `producer`, and their drops by reason:
    a segment (committed chunks only) by its totals, a per-chunk file no segment holds by its stats."""
    segments, files = listing(run_dir, producer)
    run_dir = Path(run_dir)
    sums: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    folded: set[int] = set()

    def add(stats: dict[str, Any]) -> None:
        dropped.update(stats["dropped"])
        for key in SUMMED_KEYS:
            sums[key] += stats[key]
        sums["score_sum_milli"] += round(stats["score_sum"] * 1000)

    for name, _ in segments:
        data = json.loads((run_dir / name).read_text(encoding="utf-8"))
        chunks = {int(chunk) for chunk in data.get("chunks") or {}}
        new = chunks - folded
        folded |= chunks
        total = data.get("totals") or {}
        if new == chunks and chunks <= committed and "score_sum_milli" in total:
            dropped.update(total["dropped"])
            for key in (*SUMMED_KEYS, "score_sum_milli"):
                sums[key] += total[key]
        else:  # a chunk in two segments, or one not committed: neither is written, but count right anyway
            with gc_paused():
                for chunk, stats in segment_chunks(data).items():
                    if chunk in new and chunk in committed:
                        add(stats)
    for (_, chunk), name in files.items():
        if chunk in folded or chunk not in committed:
            continue
        try:
            add(json.loads((run_dir / name).read_text(encoding="utf-8")))
        except FileNotFoundError:  # folded and deleted since the listing
            continue
    return sums, dropped


def read_all(store: Any, run_id: str, producer: str | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """(producer, chunk) -> stats over the run's segments and per-chunk files (of one producer, or all), in memory."""
    with gc_paused():
        return {(owner, chunk): stats for owner, chunk, stats, _ in iter_stats(store.run_dir(run_id), producer)}


def write_segment(store: Any, run_id: str, producer: str, chunks: dict[int, dict[str, Any]]) -> str:
    """Write `chunks` (committed chunks of `producer` -> their stats, as in their files) as one segment, atomically;
    its name."""
    name = segment_name(producer, min(chunks), max(chunks))
    order = sorted(chunks)
    data = {"version": SEGMENT_VERSION, "producer": producer, "totals": totals(chunks),
            "view": {str(chunk): {key: chunks[chunk][key] for key in VIEW_KEYS if key in chunks[chunk]}
                     for chunk in order},
            "chunks": {str(chunk): json.dumps(chunks[chunk]) for chunk in order}}
    store.write_run_file(run_id, name, json.dumps(data, separators=(",", ":")))
    return name


def delete_files(store: Any, run_id: str, names: list[str]) -> list[str]:
    """Delete per-chunk files a segment holds; the names that could not be deleted (the next fold tries again)."""
    run_dir, failed = Path(store.run_dir(run_id)), []
    for name in names:
        try:
            (run_dir / name).unlink(missing_ok=True)
        except OSError as error:
            logger.warning("could not delete %s (its segment holds it): %s", name, error)
            failed.append(name)
    return failed


def fold(store: Any, run_id: str, producer: str, chunks: dict[int, dict[str, Any]],
         leftovers: list[str] = ()) -> tuple[str | None, list[str]]:
    """Write `chunks` as one segment, then delete their per-chunk files and `leftovers` (files of chunks an earlier
    segment already holds); the segment's name (None when `chunks` is empty) and the files not deleted."""
    name = write_segment(store, run_id, producer, chunks) if chunks else None
    return name, delete_files(store, run_id, [*(chunk_stats_name(producer, chunk) for chunk in chunks), *leftovers])


class Folder:
    """The producer's single writer's side: the committed chunks still in per-chunk files, folded into a segment
    once there are `threshold` of them. Plain; `DatagenRun` owns one and calls `committed` after each commit."""

    def __init__(self, store: Any, run_id: str, producer: str, start: Restore, committed: set[int],
                 threshold: int | None = None) -> None:
        """`start`: the producer's stats as a resume read them (read here if it did not); `committed`: its chunks
        whose shard is committed."""
        self.store, self.run_id, self.producer = store, run_id, producer
        self.threshold = FOLD_CHUNKS if threshold is None else threshold
        start.finish()
        self.unfolded: dict[int, dict[str, Any]] = {chunk: stats for chunk, stats in start.unfolded.items()
                                                    if chunk in committed}
        self.leftovers = [name for chunk, name in start.files.items() if chunk in start.folded]
        """Per-chunk files of chunks a segment already holds (a kill between a fold's two steps): deleted by the
        next fold."""
        self.segments: list[str] = []

    def committed(self, chunk: int, stats: dict[str, Any]) -> str | None:
        """A chunk's shard was committed with these stats (as written to its file); folds when due."""
        self.unfolded[chunk] = stats
        return self.fold_if_due()

    def fold_if_due(self) -> str | None:
        """Fold the unfolded chunks once there are `threshold` of them; the new segment's name, or None.

        A failed write leaves the per-chunk files as they are (the data stays readable) and is retried by the
        next call; the commit it follows stands. Files left by an interrupted fold are deleted either way."""
        if len(self.unfolded) < self.threshold:
            if self.leftovers:
                self.leftovers = delete_files(self.store, self.run_id, self.leftovers)
            return None
        try:  # (the deletions after the segment's write do not raise: they come back as `leftovers`)
            name, self.leftovers = fold(self.store, self.run_id, self.producer, self.unfolded, self.leftovers)
        except (OSError, RuntimeError) as error:  # StoreError is a RuntimeError
            logger.warning("folding %d chunk stats files of %s failed (kept as they are): %s", len(self.unfolded),
                           self.producer, error)
            return None
        self.unfolded = {}
        self.segments.append(name)
        return name
