"""Which chunk the datagen flow draws next, with what difficulty plan, and when it stops: dynamic sampling.

Two ways to size a run:

- fixed (`datagen.target_groups` unset): chunks `0 .. ceil(env.total_items / chunk_items) - 1`, as before;
- target (`datagen.target_groups: G`): chunks 0, 1, 2, ... are drawn until G groups of this producer are
  committed, or until `datagen.max_items` items were tried (default 10 x G), which stops a hopeless run
  with a message saying so. The chunk that crosses the target is trimmed to exactly G (its first groups in
  item order); chunks still in flight after that are thrown away uncommitted. So a finished run holds
  exactly G groups, also when it was killed and rerun.

Exactly-once: chunk k is always items `[k*c, (k+1)*c)` and its items are a pure function of the seed, k and
the curriculum plan, and the plan for chunk k is the curriculum state after the committed chunks
`<= k - chunks_in_flight` (the flow commits chunks in order, and with `chunks_in_flight` d, chunks up to
k - d are committed when chunk k is drawn). On resume the state is rebuilt by replaying the committed chunks'
outcomes from their stats (per-chunk files and folded segments: factory/chunk_stats.py), so a rerun draws
exactly the items an uninterrupted run would have drawn, commits nothing twice and leaves no gap. (Changing
`chunks_in_flight` between a run and its rerun changes the plan lag, hence the levels of later chunks; nothing is
duplicated either way.)
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from factory.chunk_stats import Restore
from factory.chunk_stats import chunk_stats_name as chunk_stats_name  # where it was defined before
from factory.curriculum import Curriculum, CurriculumSettings, ItemOutcome
from factory.gc_pause import gc_paused
from factory.store import ShardStore

logger = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS_PER_GROUP = 10
"""`max_items` defaults to this many items per target group."""


def curriculum_state_name(producer: str) -> str:
    return f"curriculum-{producer}.json"


def outcomes_of(grouped: Any, kept_keys: set[str], solved: Callable[[Any, float], bool]) -> list[ItemOutcome]:
    """The curriculum's view of a grouped chunk: per item with a family and level, passes and kept-or-not."""
    out = []
    for item, scores in getattr(grouped, "outcomes", []):
        family, level = item.info.get("family"), item.info.get("difficulty")
        if family is None or level is None:
            continue
        passed = sum(1 for s in scores if solved(item, s)) if scores else 0
        out.append(ItemOutcome(str(family), int(level), passed, len(scores or []), item.key in kept_keys))
    return out


class DynamicSampling:
    """The flow's chunk planner: next chunk, its plan, trimming to the target, curriculum updates and state."""

    def __init__(self, store: ShardStore, *, run_id: str, producer: str, chunk_items: int, total_items: int,
                 target_groups: int | None = None, max_items: int | None = None, chunks_in_flight: int = 1,
                 curriculum: Curriculum | None = None, solved: Callable[[Any, float], bool] | None = None,
                 chunk_stats: Restore | None = None) -> None:
        """`chunk_stats`: the producer's chunk stats to replay (`factory.chunk_stats.Restore`; made here when not
        given), streamed, not kept."""
        self.store, self.run_id, self.producer = store, run_id, producer
        self.chunk_items = chunk_items
        self.target = target_groups
        if target_groups is not None:
            self.max_items = max_items if max_items is not None else DEFAULT_MAX_ITEMS_PER_GROUP * target_groups
        else:
            self.max_items = total_items if max_items is None else min(total_items, max_items)
        self.lag = max(1, chunks_in_flight)
        self.curriculum = curriculum
        self.solved = solved or (lambda item, score: score > 0)
        self.trimmed = 0
        self.discarded_chunks = 0
        self._plans: dict[int, dict[str, Any]] = {}
        self._initial_plan = curriculum.plan() if curriculum is not None else None
        records = [r for r in store.committed(run_id).values() if r.producer == producer]
        self.committed_chunks = {r.chunk for r in records}
        self.committed_groups = sum(r.rows for r in records)
        self.committed_items = 0
        self._trimmed_committed = 0
        restore = chunk_stats if chunk_stats is not None else Restore(store.run_dir(run_id), producer)
        order, pending, done = sorted(self.committed_chunks), {}, 0
        with gc_paused():  # replayed in chunk order as the stats stream in (segments and files are mostly in order)
            for chunk, stats in restore:
                if chunk not in self.committed_chunks:
                    continue
                pending[chunk] = stats
                while done < len(order) and order[done] in pending:
                    self._replay(order[done], pending.pop(order[done]))
                    done += 1
            for chunk in order[done:]:  # committed chunks without stats (count by chunk length), and any held back
                self._replay(chunk, pending.pop(chunk, {}))
        self.restored_chunks = len(records)
        if records:
            self.save_curriculum()  # a kill between a commit and its state write left the file one chunk behind
        self._next = 0
        self._fixed_todo = [k for k in range(self.n_chunks) if k not in self.committed_chunks] if self.target is None else []

    def _replay(self, chunk: int, stats: dict[str, Any]) -> None:
        """Restore one committed chunk from its stats: items, trimming, the curriculum's outcomes and plan."""
        self._trimmed_committed += int(stats.get("trimmed_over_target", 0))
        self.committed_items += int(stats.get("items", self._chunk_len(chunk)))
        if self.curriculum is not None:
            outcomes = [ItemOutcome.from_list(row) for row in stats.get("curriculum", [])]
            self.curriculum.apply(chunk, outcomes, stats.get("groups_kept_by_family"))
            self._plans[chunk] = self.curriculum.plan()

    # ---- sizing ----
    @property
    def n_chunks(self) -> int:
        """Chunks the run may use at most (fixed mode: all of them)."""
        return math.ceil(self.max_items / self.chunk_items)

    def _chunk_len(self, chunk: int) -> int:
        return max(0, min((chunk + 1) * self.chunk_items, self.max_items) - chunk * self.chunk_items)

    def indices(self, chunk: int) -> range:
        return range(chunk * self.chunk_items, min((chunk + 1) * self.chunk_items, self.max_items))

    def target_reached(self) -> bool:
        return self.target is not None and self.committed_groups >= self.target

    def todo_chunks(self) -> int:
        """Chunks still to draw in fixed mode; in target mode an estimate is meaningless, so -1."""
        return len(self._fixed_todo) if self.target is None else -1

    def next_chunk(self) -> int | None:
        """The next chunk to draw, or None when the run is done (target reached, items used up)."""
        chunk = self.peek_chunk()
        if chunk is not None:
            if self.target is None:
                self._fixed_todo.pop(0)
            else:
                self._next = chunk + 1
        return chunk

    def peek_chunk(self) -> int | None:
        """What `next_chunk` would return, without drawing it."""
        if self.target is None:
            return self._fixed_todo[0] if self._fixed_todo else None
        if self.target_reached():
            return None
        while self._next in self.committed_chunks:
            self._next += 1
        return self._next if self._next < self.n_chunks else None

    def enough_in_flight(self, in_flight_items: int) -> bool:
        """Whether the chunks in flight are expected to reach the target (so wait for them before drawing more)."""
        if self.target is None or in_flight_items == 0 or self.committed_items == 0:
            return False
        kept_per_item = self.committed_groups / self.committed_items
        return self.committed_groups + kept_per_item * in_flight_items >= self.target

    def plan_final(self, chunk: int) -> bool:
        """Whether `plan_for(chunk)` is already what an uninterrupted run and a rerun draw chunk `chunk` with: no
        curriculum, or chunk - lag committed (or before the first chunk). A rollout task run covering several chunks
        adds a chunk only then, so its items stay a pure function of the seed, the chunk and the committed state."""
        return self.curriculum is None or chunk - self.lag < 0 or chunk - self.lag in self.committed_chunks

    def plan_for(self, chunk: int) -> dict[str, Any] | None:
        """The curriculum plan chunk `chunk` is drawn with: the state after committed chunks <= chunk - lag."""
        if self.curriculum is None:
            return None
        before = [k for k in self._plans if k <= chunk - self.lag]
        return self._plans[max(before)] if before else self._initial_plan

    # ---- finishing a chunk ----
    def admit(self, chunk: int, grouped: Any) -> bool:
        """Decide what of a finished chunk is committed: False to throw it away (target already reached);
        else trims `grouped.groups` to what the target still needs."""
        if self.target is None:
            return True
        if self.target_reached():
            self.discarded_chunks += 1
            return False
        need = self.target - self.committed_groups
        if len(grouped.groups) > need:
            grouped.trimmed = len(grouped.groups) - need
            self.trimmed += grouped.trimmed
            grouped.groups = grouped.groups[:need]
        return True

    def chunk_stats(self, chunk: int, grouped: Any) -> dict[str, Any]:
        """What the chunk's stats file records beyond the group counts: items, trimming, curriculum outcomes."""
        extra: dict[str, Any] = {"items": len(getattr(grouped, "outcomes", [])) or self._chunk_len(chunk),
                                 "trimmed_over_target": getattr(grouped, "trimmed", 0)}
        if self.curriculum is not None:
            keys = getattr(grouped.groups, "item_keys", None)  # GroupColumns: without making a ScoredGroup per group
            kept = set(keys) if keys is not None else {g.item_key for g in grouped.groups}
            outcomes = outcomes_of(grouped, kept, self.solved)
            by_family: Counter[str] = Counter(o.family for o in outcomes if o.kept)
            extra["curriculum"] = [o.to_list() for o in outcomes]
            extra["groups_kept_by_family"] = dict(by_family)
            extra["plan"] = self.plan_for(chunk)
        return extra

    def committed(self, chunk: int, stats: dict[str, Any]) -> list[dict[str, Any]]:
        """Account for a committed chunk (its stats as written); returns curriculum level moves."""
        self.committed_chunks.add(chunk)
        self.committed_groups += int(stats["groups_kept"])
        self.committed_items += int(stats["items"])
        self._trimmed_committed += int(stats.get("trimmed_over_target", 0))
        if self.curriculum is None:
            return []
        moves = self.curriculum.apply(chunk, [ItemOutcome.from_list(r) for r in stats.get("curriculum", [])],
                                      stats.get("groups_kept_by_family"))
        self._plans[chunk] = self.curriculum.plan()
        self.save_curriculum()
        return moves

    def save_curriculum(self) -> None:
        if self.curriculum is not None:
            self.store.write_run_file(self.run_id, curriculum_state_name(self.producer),
                                      json.dumps(self.curriculum.to_dict(), indent=1))

    # ---- reporting ----
    def progress(self) -> float:
        """Percent done: committed groups of the target, or committed chunks of the fixed run."""
        if self.target is not None:
            return min(100.0, 100.0 * self.committed_groups / max(self.target, 1))
        return 100.0 * len(self.committed_chunks & set(range(self.n_chunks))) / max(self.n_chunks, 1)

    def stop_reason(self) -> str:
        if self.target is None:
            return "total_items"
        return "target_groups" if self.target_reached() else "max_items"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target_groups": self.target, "max_items": self.max_items,
                               "items_tried": self.committed_items, "stop_reason": self.stop_reason(),
                               "trimmed_over_target": self.trimmed_total(),
                               "chunks_thrown_away": self.discarded_chunks,
                               "kept_per_item": round(self.committed_groups / self.committed_items, 4)
                               if self.committed_items else None}
        if self.curriculum is not None:
            out["curriculum_levels"] = self.curriculum.levels()
        return out

    def trimmed_total(self) -> int:
        """Groups trimmed over the target, over every committed chunk of the run (restored ones and this session's)."""
        return self._trimmed_committed


def make_curriculum(settings: CurriculumSettings, env: Any, *, start_level: int | None = None) -> Curriculum | None:
    """The curriculum for an environment, or None when disabled; an env without a difficulty knob is an error."""
    if not settings.enabled:
        return None
    families = env.curriculum_families()
    if not families:
        raise ValueError(f"datagen.curriculum.enabled needs an environment with difficulty levels per family; "
                         f"{type(env).__name__} has none (InternBootcamp has)")
    base = env.base_weights() if hasattr(env, "base_weights") else None
    return Curriculum(settings, families, levels=env.difficulty_range(), start_level=start_level, base_weights=base)

