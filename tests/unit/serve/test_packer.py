"""The batch packer: exact sizes, whole groups, minimums and weights honoured, arrival order otherwise."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from factory.serve.packer import Entry, LanePolicy, exact_subset, pack_batch, required_sequences


def make_queues(specs: list[tuple[int, int]]) -> dict[int, list[Entry]]:
    """(lane, size) per group, in arrival order."""
    queues: dict[int, list[Entry]] = {}
    for seq, (lane, size) in enumerate(specs):
        queues.setdefault(lane, []).append(Entry(seq, 0, seq, size, lane, 0))
    return queues


group_specs = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12)), max_size=60)
batch_sizes = st.integers(1, 64)


@settings(max_examples=300, deadline=None)
@given(group_specs, batch_sizes)
def test_batches_are_exact_whole_groups_from_the_queue(specs, batch_size):
    queues = make_queues(specs)
    batch = pack_batch(queues, batch_size, {})
    if batch is None:
        return
    assert sum(entry.size for entry in batch) == batch_size
    assert len({id(entry) for entry in batch}) == len(batch)
    queued = {id(entry) for queue in queues.values() for entry in queue}
    assert all(id(entry) in queued for entry in batch)


@settings(max_examples=300, deadline=None)
@given(group_specs, batch_sizes)
def test_a_batch_is_found_whenever_one_exists(specs, batch_size):
    """No minimums, single lane weights: if any subset of groups sums to batch_size, a batch is formed."""
    queues = make_queues(specs)
    sizes = [size for _, size in specs]
    reachable = {0}
    for size in sizes:
        reachable |= {total + size for total in reachable if total + size <= batch_size}
    batch = pack_batch(queues, batch_size, {})
    assert (batch is not None) == (batch_size in reachable)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from([1, 2, 4, 8])), max_size=80),
    st.sampled_from([8, 16, 32]),
    st.floats(0.1, 0.6),
)
def test_minimum_allocation_is_honoured(specs, batch_size, fraction):
    queues = make_queues(specs)
    lanes = {0: LanePolicy(min_fraction=fraction)}
    batch = pack_batch(queues, batch_size, lanes)
    need = int(batch_size * fraction)
    lane0 = sum(size for lane, size in specs if lane == 0)
    if lane0 < need:
        assert batch is None, "Atropos forms no batch when a minimum cannot be met"
    if batch is not None:
        assert sum(e.size for e in batch) == batch_size
        assert sum(e.size for e in batch if e.lane == 0) >= need


def test_arrival_order_when_everything_fits():
    queues = make_queues([(0, 4), (1, 4), (0, 4), (1, 4), (0, 4)])
    batch = pack_batch(queues, 12, {})
    assert [e.seq for e in batch] == [0, 1, 2]


def test_mixed_sizes_packed_exactly_skipping_what_does_not_fit():
    queues = make_queues([(0, 8), (0, 3), (0, 8), (0, 5)])
    batch = pack_batch(queues, 16, {})
    assert [e.seq for e in batch] == [0, 1, 3], "the earliest groups that complete the batch exactly"
    assert pack_batch(make_queues([(0, 8), (0, 3), (0, 8)]), 16, {}) is not None
    batch = pack_batch(make_queues([(0, 3), (0, 8), (0, 5)]), 8, {})
    assert [e.seq for e in batch] == [0, 2]


def test_weights_share_the_batch_when_lanes_have_backlog():
    specs = [(0, 2)] * 20 + [(1, 2)] * 20
    batch = pack_batch(make_queues(specs), 12, {0: LanePolicy(weight=2.0), 1: LanePolicy(weight=1.0)})
    per_lane = {lane: sum(e.size for e in batch if e.lane == lane) for lane in (0, 1)}
    assert per_lane == {0: 8, 1: 4}


def test_minimum_takes_from_the_lane_front_even_if_its_groups_arrived_last():
    specs = [(1, 4)] * 10 + [(0, 4)] * 2
    batch = pack_batch(make_queues(specs), 16, {0: LanePolicy(min_fraction=0.5)})
    assert sum(e.size for e in batch if e.lane == 0) == 8


def test_inactive_lane_minimum_is_not_enforced():
    specs = [(1, 4)] * 4
    assert pack_batch(make_queues(specs), 16, {0: LanePolicy(min_fraction=0.5, active=False)}) is not None
    assert pack_batch(make_queues(specs), 16, {0: LanePolicy(min_fraction=0.5)}) is None


def test_minimums_over_the_batch_are_scaled_down():
    required = required_sequences(10, {0: LanePolicy(min_fraction=0.8), 1: LanePolicy(min_fraction=0.8)})
    assert sum(required.values()) <= 10 and required[0] == required[1] == 5


def test_exact_subset_is_lexicographically_first():
    assert exact_subset([5, 3, 2, 5], 5) == [0]
    assert exact_subset([3, 4, 2], 5) == [0, 2]
    assert exact_subset([3, 3], 5) is None


def test_newest_first_takes_the_latest_groups():
    queues = make_queues([(0, 4), (1, 4), (0, 4), (1, 4), (0, 4)])
    newest = {lane: list(reversed(entries)) for lane, entries in queues.items()}  # as the queue gives them
    assert [e.seq for e in pack_batch(newest, 12, {}, newest_first=True)] == [4, 3, 2]
    minimum = {0: LanePolicy(min_fraction=0.5)}
    assert [e.seq for e in pack_batch(newest, 8, minimum, newest_first=True)] == [4, 3]
