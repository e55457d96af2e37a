"""GET /batch as an Arrow stream: content negotiation, the stream's rows, and the same served-step accounting as JSON."""

from __future__ import annotations

import asyncio
import json

import orjson
import pyarrow as pa
import pytest

from factory.export.source import groups_from_arrow_stream, groups_from_batch_json
from factory.serve.payload import ARROW_COLUMNS, PayloadReader, batch_arrow, batch_json, encode_groups, prefers_arrow
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.unit.serve.test_service import REGISTRATION, config, started

ARROW = "application/vnd.apache.arrow.stream"


@pytest.mark.parametrize("accept, arrow", [
    (f"{ARROW}, application/json;q=0.5", True),
    (ARROW, True),
    (f"application/json, {ARROW};q=0.9", False),
    (f"{ARROW};q=0", False),
    (f"{ARROW};q=bad", False),
    (f"application/json;q=0.5, {ARROW}; q=0.8", True),
    ("application/json", False),
    ("*/*", False),
    ("", False),
])
def test_arrow_only_for_clients_that_prefer_it(accept, arrow):
    assert prefers_arrow(accept) is arrow


def _stored_rows(tmp_path, rows):
    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(20, group_size=3, seq_len=12, run_id="r"))
    store.commit("r", "p", 0, groups, row_group_groups=4)
    return PayloadReader(1 << 20).read([(store.shard_paths("r")[0], row) for row in rows])


@pytest.mark.parametrize("compress", [False, True])
def test_arrow_stream_reads_as_the_json_with_metadata(tmp_path, compress):
    table = _stored_rows(tmp_path, [7, 4, 5, 19, 0])
    stream = batch_arrow(table, compress=compress)
    assert pa.ipc.open_stream(stream).schema.names == ARROW_COLUMNS
    from_arrow = groups_from_arrow_stream(stream)
    from_json = groups_from_batch_json(batch_json(encode_groups(table, metadata=True)))
    assert len(from_arrow) == len(from_json) == 5
    for arrow, plain, run_id, item_key in zip(from_arrow, from_json, table["run_id"].to_pylist(), table["item_key"].to_pylist()):
        assert (arrow.group_id, arrow.env, arrow.scores) == (plain.group_id, plain.env, plain.scores)
        assert (arrow.seq_lens, arrow.completion_lens, arrow.messages) == (plain.seq_lens, plain.completion_lens, plain.messages)
        assert [arrow.tokens(i) for i in range(3)] == [plain.tokens(i) for i in range(3)]
        assert [arrow.masks(i) for i in range(3)] == [plain.masks(i) for i in range(3)]
        assert (arrow.run_id, arrow.item_key) == (run_id, item_key) and run_id == "r" and item_key


def test_served_steps_are_the_same_whichever_format_is_asked(tmp_path):
    """Batches asked for in turn as Arrow and JSON (so prefetched in the other format): one step each, every group once."""

    async def scenario():
        service = await started(config(tmp_path, batch_metadata=True))
        await service.register(REGISTRATION)
        posted = list(synthetic_groups(6, group_size=4, seq_len=8))
        await service.ingest(posted)
        served, steps = [], []
        for call in range(4):
            arrow = call % 2 == 0
            body = await service.next_batch(False, arrow=arrow)
            if arrow and body.arrow is not None:
                served.append([g.group_id for g in groups_from_arrow_stream(body.arrow)])
            else:
                served.append([g["group_id"] for g in orjson.loads(body.raw)["batch"] or []])
            steps.append(service.step)
        taken = service.state.served_groups()
        await service.stop()
        return posted, served, steps, taken

    posted, served, steps, taken = run(scenario())
    assert [len(ids) for ids in served] == [2, 2, 2, 0]  # batch_size 8 = two groups of 4; the fourth call finds none
    assert steps == [1, 2, 3, 3]
    assert sorted(i for ids in served for i in ids) == sorted(g.group_id for g in posted)
    assert taken == 6


def test_bodies_without_rows_stay_json_for_arrow_clients(tmp_path):
    async def scenario():
        service = await started(config(tmp_path))
        unregistered = await service.next_batch(False, arrow=True)
        await service.register(REGISTRATION)
        empty = await service.next_batch(False, arrow=True)
        await service.stop()
        return unregistered, empty

    unregistered, empty = run(scenario())
    assert unregistered.arrow is None and json.loads(unregistered.raw)["message"].startswith("Trainer not registered")
    assert empty.arrow is None and empty.raw == b'{"batch":null}'


def run(coro):
    return asyncio.run(coro)
