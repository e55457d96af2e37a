"""The compact in-memory queue: one `Entry` per queued group, per-lane deques in arrival order.

Payloads never live here (they stay in their shards), so memory grows by a
couple of hundred bytes per queued group, not by the group's tokens.
Entries taken for a batch that is being prepared are RESERVED (kept in place,
so releasing them restores their position); served or skipped ones become
GONE and are dropped from the front of their deque lazily.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterator

from factory.serve.packer import GONE, QUEUED, RESERVED, Entry


class GroupQueue:
    """Queued groups by lane with running counts for /status and /status-env."""

    def __init__(self) -> None:
        self._lanes: dict[int, deque[Entry]] = {}
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
        for entry in reversed(self._lanes[lane]) if newest_first else self._lanes[lane]:
            if covered >= sequences:
                return
            if entry.state == QUEUED:
                covered += entry.size
                yield entry

    def lanes(self) -> list[int]:
        return [lane for lane, count in self.lane_groups.items() if count > 0]

    def max_group_size(self) -> int:
        return max(self._sizes, default=1)

    def clear(self) -> list[Entry]:
        """Every QUEUED or RESERVED entry, removed (for /reset_data)."""
        dropped = [entry for lane in self._lanes.values() for entry in lane if entry.state != GONE]
        self.remove(dropped)
        return dropped
