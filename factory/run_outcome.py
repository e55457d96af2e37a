"""How a datagen run ends and what its summary counts: the true totals, a missed target as a failure, clean start-up.

- Every chunk generated is counted. A chunk thrown away uncommitted (the target was reached by an earlier chunk)
  is recorded in `discarded-<producer>.json`, so `items_tried` and `rollouts` cover it, also after a resume.
- A target run that used up `datagen.max_items` without reaching `datagen.target_groups` ends with
  `TargetMissed`: the flow run is Failed (not retried: a retry draws no new items) and the command exits 1,
  its last line giving the true numbers.
- On start-up, what a killed or failed process left is removed: hidden temporary files of this producer's run
  files and shards (after finishing commits whose record is durable), and chunk stats files whose chunk was
  never committed (folded segments of chunk stats hold committed chunks only and are kept).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from factory.chunk_stats import parse_name
from factory.cli_errors import UserError

logger = logging.getLogger(__name__)


class TargetMissed(UserError):
    """A target_groups run used up max_items without reaching its target."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.summary = summary or {}


def discarded_name(producer: str) -> str:
    return f"discarded-{producer}.json"


def read_discarded(store: Any, run_id: str, producer: str) -> dict[str, int]:
    """Totals of the chunks generated and then thrown away uncommitted, over every session of the run."""
    path = store.run_dir(run_id) / discarded_name(producer)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        data = {}
    return {key: int(data.get(key, 0)) for key in ("chunks", "items", "rollouts", "groups")}


def record_discarded(store: Any, run_id: str, producer: str, *, items: int, rollouts: int, groups: int) -> None:
    """Count one chunk that was generated and thrown away uncommitted."""
    totals = read_discarded(store, run_id, producer)
    totals["chunks"] += 1
    totals["items"] += items
    totals["rollouts"] += rollouts
    totals["groups"] += groups
    store.write_run_file(run_id, discarded_name(producer), json.dumps(totals))


def count_discarded(store: Any, run_id: str, producer: str, grouped: Any) -> None:
    """`record_discarded` for a grouped chunk (tasks/group.GroupedChunk)."""
    items = len(getattr(grouped, "outcomes", []) or [])
    record_discarded(store, run_id, producer, items=items, rollouts=int(getattr(grouped, "rollouts", 0)),
                     groups=len(getattr(grouped, "groups", []) or []))


def whole_run_totals(summary: dict[str, Any], discarded: dict[str, int]) -> dict[str, Any]:
    """The summary with thrown-away chunks added to items_tried and rollouts (their own counts kept too)."""
    out = dict(summary)
    out["rollouts"] = int(summary.get("rollouts") or 0) + discarded["rollouts"]
    if "items_tried" in summary:
        out["items_tried"] = int(summary.get("items_tried") or 0) + discarded["items"]
    out["chunks_thrown_away"] = discarded["chunks"]
    out["items_thrown_away"] = discarded["items"]
    out["rollouts_thrown_away"] = discarded["rollouts"]
    return out


def dropped_wording(kept: int, dropped: dict[str, int]) -> str:
    """What happened to the groups, in words that match the numbers."""
    total_dropped = sum(dropped.values())
    generated = kept + total_dropped
    if generated == 0:
        return "no group was generated"
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(dropped.items(), key=lambda kv: -kv[1])
                        if count)
    share = 100.0 * kept / generated
    if total_dropped == 0:
        return f"all {kept} groups generated were kept"
    verdict = "most groups were dropped" if total_dropped > kept else "most groups were kept"
    return f"{verdict}: {kept} of {generated} kept ({share:.0f}%), {total_dropped} dropped ({reasons})"


def target_missed_message(summary: dict[str, Any]) -> str | None:
    """The one line for a target run that stopped at max_items short of its target; None otherwise."""
    target = summary.get("target_groups")
    kept = int(summary.get("groups_kept") or 0)
    if target is None or kept >= int(target) or summary.get("stop_reason") != "max_items":
        return None
    items = int(summary.get("items_tried") or 0)
    rollouts = int(summary.get("rollouts") or 0)
    dropped = {k: int(v) for k, v in (summary.get("dropped") or {}).items()}
    if kept:
        needed = int(target) * items // kept + 1
        fix = f"raise datagen.max_items to about {needed} (at {kept / max(items, 1):.2f} groups per item)"
    else:
        fix = "no item gave a group: check the drop reasons (env.ensure_scores_are_not_same, env.max_token_length)"
    return (f"{MISSED_PREFIX}kept {kept} of datagen.target_groups={target} groups after "
            f"datagen.max_items={summary.get('max_items')} ({items} items tried, {rollouts} rollouts; "
            f"{dropped_wording(kept, dropped)}); {fix}, or make the items fit the policy "
            "(env.difficulties, datagen.curriculum)")


MISSED_PREFIX = "missed the target: "


def raise_if_target_missed(state: Any) -> None:
    """After the pipeline subflow: a Failed state for a missed target fails the calling run without retries."""
    message = getattr(state, "message", None) or ""
    if state.is_failed() and message.startswith(MISSED_PREFIX):
        from factory.run_control import fail_without_retry

        fail_without_retry(message)
        raise TargetMissed(message)


def final_result(state: Any) -> Any:
    """The pipeline subflow's result; a missed target or a dead model server fails the calling run without retries
    (a retry draws no new items / finds no server), with the one-line cause."""
    raise_if_target_missed(state)
    from factory.inference.health import EndpointsDown

    try:
        return state.result()
    except EndpointsDown as error:
        from factory.run_control import fail_without_retry

        fail_without_retry(str(error))
        raise


def pipeline_failed_here(error: BaseException) -> None:
    """The pipeline ran in the calling flow run and raised: dead model servers fail that run without retries."""
    from factory.inference.health import EndpointsDown

    if isinstance(error, EndpointsDown):
        from factory.run_control import fail_without_retry

        fail_without_retry(str(error))


def check_outcome(summary: dict[str, Any]) -> None:
    """Raise TargetMissed when the summary says the run missed its target."""
    if (message := target_missed_message(summary)) is not None:
        raise TargetMissed(message, summary)


# ---- start-up cleanup ---------------------------------------------------------------------------------------------

def _stats_chunk(name: str, producer: str) -> int | None:
    """The chunk of `producer`'s per-chunk stats file `name`; None for any other name (a segment included)."""
    parsed = parse_name(name)
    return parsed[2] if parsed is not None and parsed[0] == "chunk" and parsed[1] == producer else None


def clean_start(store: Any, run_id: str, producer: str) -> list[str]:
    """Remove what a stopped process of this producer left; returns the names removed.

    Call it only while owning the run (no other writer of this producer): committed shards still under their
    temporary name are renamed into place first, then the producer's remaining hidden temporary files (shards,
    stats, config, curriculum) go, and so do stats files of chunks that were never committed. The temporary file
    of a committed shard that could not be renamed into place is kept: it is that shard's only copy.
    """
    from factory.store import staged_shard

    run_dir = store.run_dir(run_id)
    if not run_dir.is_dir():
        return []
    store.finish_commits(run_id)
    removed: list[str] = []
    shard_tmp = re.compile(rf"\.{re.escape(producer)}-\d{{8}}\.parquet\.[0-9a-f]+\.tmp")
    own_files = ("stats-", "config-", "curriculum-", "discarded-")
    run_tmp = re.compile(rf"\.(?:{'|'.join(own_files)}){re.escape(producer)}(?:-\d{{8}}|\.chunks-\d{{8}}-\d{{8}})?"
                         rf"\.(?:json|yaml)\.[0-9a-f]+\.tmp")
    records = store.committed(run_id)
    shards = store.shards_dir(run_id)  # an object store's (a key prefix) holds no temporary objects
    for path in list(shards.glob(".*.tmp")) if isinstance(shards, Path) and shards.is_dir() else []:
        if not shard_tmp.fullmatch(path.name):
            continue
        shard = staged_shard(path.name)
        if shard in records and not (shards / shard).exists():
            # the only copy of a committed shard (finish_commits could not rename it): the next commit or read will
            logger.error("kept %s: shard %s is committed but not renamed into place yet", path.name, shard)
            continue
        path.unlink(missing_ok=True)
        removed.append(f"shards/{path.name}")
    committed = {r.chunk for r in records.values() if r.producer == producer}
    for path in run_dir.iterdir():
        if run_tmp.fullmatch(path.name):
            path.unlink(missing_ok=True)
            removed.append(path.name)
        elif (chunk := _stats_chunk(path.name, producer)) is not None and chunk not in committed:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        logger.warning("removed %d file(s) a stopped run left in %s: %s", len(removed), run_dir, ", ".join(removed))
    return removed


def forget_stats(store: Any, run_id: str, name: str) -> None:
    """Remove a chunk's stats file after its commit failed (no stats file for an uncommitted chunk)."""
    (store.run_dir(run_id) / name).unlink(missing_ok=True)
