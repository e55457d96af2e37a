"""The compact in-memory queue: per-lane deques in arrival order, of `Entry`s and of `Block`s of many groups.

Payloads never live here (they stay in their shards). A group that arrives alone (a post, a small commit) is
one `Entry`; the groups of a whole scan or a compacted file arrive as one `Block` per lane (numpy arrays of
their keys and sizes, ~30 bytes a group) and become `Entry`s only when a batch is formed from them, a chunk at
a time from the end the batch is taken from: a start-up over millions of groups costs a few array operations,
not a Python object per group.
Entries taken for a batch that is being prepared are RESERVED (kept in place,
so releasing them restores their position); served or skipped ones become
GONE and are dropped from the front of their deque lazily.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterator
from typing import Any

from factory.serve.packer import GONE, QUEUED, RESERVED, Entry

CHUNK = 1024
"""Groups of a block made into `Entry`s at a time (a batch of 256 sequences needs a few hundred at most)."""


class Block:
    """Queued groups of one lane not yet made into `Entry`s: rows `lo..hi` of parallel arrays, in arrival order."""

    state = QUEUED
    """A block is never at the front as GONE: `remove` stops at it."""

    def __init__(self, seqs: Any, sources: Any, rows: Any, sizes: Any, versions: Any, lane: int) -> None:
        self.seqs, self.sources, self.rows, self.sizes, self.versions = seqs, sources, rows, sizes, versions
        self.lane = lane
        self.lo, self.hi = 0, len(seqs)

    def __len__(self) -> int:
        return self.hi - self.lo

    def entries(self, lo: int, hi: int) -> list[Entry]:
        lane = self.lane
        return [
            Entry(seq, source, row, size, lane, version)
            for seq, source, row, size, version in zip(
                self.seqs[lo:hi].tolist(), self.sources[lo:hi].tolist(), self.rows[lo:hi].tolist(),
                self.sizes[lo:hi].tolist(), self.versions[lo:hi].tolist())
        ]

    def take_front(self, count: int) -> list[Entry]:
        lo = self.lo
        self.lo = min(self.hi, lo + count)
        return self.entries(lo, self.lo)

    def take_back(self, count: int) -> list[Entry]:
        hi = self.hi
        self.hi = max(self.lo, hi - count)
        return self.entries(self.hi, hi)


def _counts(values: Any) -> list[tuple[int, int]]:
    """(value, how many) of a numpy integer array, ascending: by counting where the values are small and not
    negative (lanes, group sizes), not by sorting (a start-up queues millions of groups at once)."""
    import numpy as np

    if not len(values):
        return []
    low, high = int(values.min()), int(values.max())
    if low == high:  # one lane, one group size: the usual start-up, not worth a count (~0.1 s over 10M groups)
        return [(low, len(values))]
    if 0 <= low and high < 1 << 16:
        counts = np.bincount(values)
        present = np.flatnonzero(counts)
        return list(zip(present.tolist(), counts[present].tolist()))
    found, counts = np.unique(values, return_counts=True)
    return list(zip(found.tolist(), counts.tolist()))


def _distinct(values: Any) -> list[int]:
    return [value for value, _ in _counts(values)]


class GroupQueue:
    """Queued groups by lane with running counts for /status and /status-env."""

    def __init__(self) -> None:
        self._lanes: dict[int, deque[Entry | Block]] = {}
        self._lane_keys: dict[Hashable, int] = {}
        self.lane_key_of: list[Hashable] = []
        self.lane_sequences: Counter[int] = Counter()
        """Sequences per lane in QUEUED or RESERVED entries."""
        self.lane_groups: Counter[int] = Counter()
        self._sizes: Counter[int] = Counter()
        self.groups = 0
        self._next_seq = 0
        self.last: Entry | None = None

    def lane(self, key: Hashable) -> int:
        """Lane number of an env key (('id', env_id) or ('name', env)), made on first use."""
        lane = self._lane_keys.get(key)
        if lane is None:
            lane = self._lane_keys[key] = len(self.lane_key_of)
            self.lane_key_of.append(key)
            self._lanes[lane] = deque()
        return lane

    def add(self, source: int, row: int, size: int, lane: int, version: int) -> Entry:
        entry = Entry(self._next_seq, source, row, size, lane, version)
        self._next_seq += 1
        self._lanes[lane].append(entry)
        self.lane_sequences[lane] += size
        self.lane_groups[lane] += 1
        self._sizes[size] += 1
        self.groups += 1
        self.last = entry
        return entry

    def add_many(self, sources: Any, rows: Any, sizes: Any, lanes: Any, versions: Any) -> int:
        """Queue many groups at once, in the order given (numpy arrays of one length; `lanes` from `lane`): one
        `Block` per lane, made into `Entry`s only when a batch is formed from it. Returns how many."""
        import numpy as np

        count = len(sources)
        if not count:
            return 0
        seqs = np.arange(self._next_seq, self._next_seq + count, dtype=np.int64)
        self._next_seq += count
        lanes = np.asarray(lanes)
        # ~28 bytes a queued group (an Entry is ~100): 32-bit sources, rows and sizes, 64-bit arrival and version
        sources, rows, sizes = (np.asarray(a, dtype=np.int32) for a in (sources, rows, sizes))
        versions = np.asarray(versions, dtype=np.int64)
        for lane in _distinct(lanes):
            if lane == lanes[0] and lane == lanes[-1] and (lanes == lane).all():
                pick: Any = slice(None)
            else:
                pick = np.flatnonzero(lanes == lane)
            block = Block(seqs[pick], sources[pick], rows[pick], sizes[pick], versions[pick], lane)
            self._lanes[lane].append(block)
            self.lane_sequences[lane] += int(block.sizes.sum())
            self.lane_groups[lane] += len(block)
        for size, n in _counts(sizes):
            self._sizes[size] += n
        self.groups += count
        last = count - 1
        self.last = Entry(int(seqs[last]), int(sources[last]), int(rows[last]), int(sizes[last]), int(lanes[last]),
                          int(versions[last]))
        return count

    @staticmethod
    def _open(lane: deque[Entry | Block], at: int, from_back: bool) -> None:
        """Make the next CHUNK groups of the block at index `at` into entries, in place (the block keeps the
        rest): its first ones, or (`from_back`) its last ones."""
        block = lane[at]
        assert isinstance(block, Block)
        if not from_back:
            lane.rotate(-at)
            lane.popleft()
            entries = block.take_front(CHUNK)
            if len(block):
                lane.appendleft(block)
            lane.extendleft(reversed(entries))
            lane.rotate(at)
        else:
            after = len(lane) - 1 - at
            lane.rotate(after)
            lane.pop()
            entries = block.take_back(CHUNK)
            if len(block):
                lane.append(block)
            lane.extend(entries)
            lane.rotate(-after)

    def reserve(self, entries: list[Entry]) -> None:
        for entry in entries:
            entry.state = RESERVED

    def release(self, entries: list[Entry]) -> None:
        """Put reserved entries back in the queue, at their old position."""
        for entry in entries:
            if entry.state == RESERVED:
                entry.state = QUEUED

    def remove(self, entries: list[Entry]) -> None:
        """Served or skipped: the entries leave the queue for good."""
        for entry in entries:
            if entry.state == GONE:
                continue
            entry.state = GONE
            self.lane_sequences[entry.lane] -= entry.size
            self.lane_groups[entry.lane] -= 1
            self._sizes[entry.size] -= 1
            if not self._sizes[entry.size]:
                del self._sizes[entry.size]
            self.groups -= 1
        for entry in entries:
            lane = self._lanes[entry.lane]
            while lane and lane[0].state == GONE:
                lane.popleft()

    def prefix(self, lane: int, sequences: int, newest_first: bool = False) -> Iterator[Entry]:
        """QUEUED entries from the front of a lane (its back, newest first, with `newest_first`) until `sequences`
        are covered."""
        covered = 0
        items = self._lanes[lane]
        at = 0
        while at < len(items):
            if covered >= sequences:
                return
            index = len(items) - 1 - at if newest_first else at
            entry = items[index]
            if type(entry) is Block:
                self._open(items, index, newest_first)
                continue  # the same position now holds the chunk's first entry (its last, newest first)
            if entry.state == QUEUED:
                covered += entry.size
                yield entry
            at += 1

    def lanes(self) -> list[int]:
        return [lane for lane, count in self.lane_groups.items() if count > 0]

    def max_group_size(self) -> int:
        return max(self._sizes, default=1)

    def clear(self) -> list[Entry]:
        """Every QUEUED or RESERVED entry, removed (for /reset_data)."""
        for number, lane in self._lanes.items():
            if any(type(item) is Block for item in lane):
                self._lanes[number] = deque(
                    entry for item in lane
                    for entry in (item.take_front(len(item)) if type(item) is Block else (item,)))
        dropped = [entry for lane in self._lanes.values() for entry in lane if entry.state != GONE]
        self.remove(dropped)
        return dropped
