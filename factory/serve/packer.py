"""Exact-size batch packing: `batch_size` sequences from whole groups of mixed sizes.

The packer sees each lane (one environment) as a queue in arrival order and
builds one priority order of candidate groups:

1. per-lane minimums (`min_fraction` of the batch) from the front of those lanes,
2. arrival order, but no lane beyond its weighted share of the batch,
3. everything else in arrival order.

It then takes the lexicographically first subset of that order that sums to
exactly `batch_size`: walking the order, a group is taken if and only if the
groups after it can still complete the batch (a subset-sum reachability table
kept as Python-int bitsets, so the whole thing is O(candidates) big-int ops).
Groups are never split. If a lane with a minimum cannot meet it, no batch is
formed, as in Atropos. With `newest_first` (serve config `batch_order`), each
lane's queue is given newest first and "arrival order" above reads "newest
arrival first".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

QUEUED, RESERVED, GONE = 0, 1, 2


@dataclass(slots=True, eq=False)
class Entry:
    """The compact in-memory index record of one queued group; the payload stays in its shard."""

    seq: int
    """Arrival number (orders the queue)."""
    source: int
    """Id of the shard that holds the group (see ServedState.sources)."""
    row: int
    """Row of the group within its shard."""
    size: int
    """Sequences in the group."""
    lane: int
    """Environment lane the group counts against."""
    version: int
    """Policy version that sampled the group."""
    state: int = QUEUED


@dataclass(frozen=True)
class LanePolicy:
    """How one environment shares batches."""

    weight: float = 1.0
    min_fraction: float | None = None
    active: bool = True
    """Minimums of inactive (disconnected) lanes are not enforced."""


def required_sequences(batch_size: int, lanes: Mapping[int, LanePolicy]) -> dict[int, int]:
    """Minimum sequences per lane, scaled down proportionally when the minimums exceed the batch."""
    required = {
        lane: int(batch_size * policy.min_fraction)
        for lane, policy in lanes.items()
        if policy.active and policy.min_fraction
    }
    required = {lane: n for lane, n in required.items() if n > 0}
    total = sum(required.values())
    if total > batch_size:
        required = {lane: int(n * batch_size / total) for lane, n in required.items()}
    return required


def _arrival_merge(queues: Mapping[int, Sequence[Entry]], newest_first: bool = False) -> Iterable[Entry]:
    return heapq.merge(*queues.values(), key=lambda entry: entry.seq, reverse=newest_first)


def priority_order(
    queues: Mapping[int, Sequence[Entry]], batch_size: int, lanes: Mapping[int, LanePolicy], newest_first: bool = False
) -> tuple[list[Entry], dict[int, int]] | None:
    """Candidates in the order the packer prefers them, and the per-lane minimums; None if a minimum can't be met."""
    required = required_sequences(batch_size, lanes)
    order: list[Entry] = []
    chosen: set[int] = set()
    counted: dict[int, int] = {}
    for lane, need in required.items():
        queue = queues.get(lane, ())
        if sum(entry.size for entry in queue) < need:
            return None
        have = 0
        for entry in queue:
            if have >= need:
                break
            order.append(entry)
            chosen.add(id(entry))
            have += entry.size
        counted[lane] = have

    with_data = [lane for lane, queue in queues.items() if queue]
    total_weight = sum(max(0.0, lanes.get(lane, LanePolicy()).weight) for lane in with_data)
    caps = {
        lane: (max(0.0, lanes.get(lane, LanePolicy()).weight) / total_weight * batch_size) if total_weight > 0 else batch_size
        for lane in with_data
    }
    rest: list[Entry] = []
    for entry in _arrival_merge(queues, newest_first):
        if id(entry) in chosen:
            continue
        have = counted.get(entry.lane, 0)
        if have + entry.size <= max(caps.get(entry.lane, 0.0), required.get(entry.lane, 0)):
            order.append(entry)
            counted[entry.lane] = have + entry.size
        else:
            rest.append(entry)
    order.extend(rest)
    return order, required


def exact_subset(sizes: Sequence[int], target: int) -> list[int] | None:
    """Indices of the lexicographically first subset of `sizes` summing to `target`, or None."""
    mask = (1 << (target + 1)) - 1
    reach = [0] * (len(sizes) + 1)
    reach[-1] = 1
    for i in range(len(sizes) - 1, -1, -1):
        size = sizes[i]
        below = reach[i + 1]
        reach[i] = below | ((below << size) & mask) if 0 < size <= target else below
    if not (reach[0] >> target) & 1:
        return None
    taken, remaining = [], target
    for i, size in enumerate(sizes):
        if remaining == 0:
            break
        if 0 < size <= remaining and (reach[i + 1] >> (remaining - size)) & 1:
            taken.append(i)
            remaining -= size
    return taken


def pack_batch(
    queues: Mapping[int, Sequence[Entry]], batch_size: int, lanes: Mapping[int, LanePolicy], newest_first: bool = False
) -> list[Entry] | None:
    """One batch of exactly `batch_size` sequences from the lanes' queues (arrival order each, or newest first
    each with `newest_first`), or None.

    Honours per-lane minimums (None when one can't be met) and weighted
    shares; the returned groups are in the packer's priority order.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    planned = priority_order(queues, batch_size, lanes, newest_first)
    if planned is None:
        return None
    order, required = planned
    picked = exact_subset([entry.size for entry in order], batch_size)
    if picked is None:
        return None
    batch = [order[i] for i in picked]
    got: dict[int, int] = {}
    for entry in batch:
        got[entry.lane] = got.get(entry.lane, 0) + entry.size
    if any(got.get(lane, 0) < need for lane, need in required.items()):
        return None
    return batch
