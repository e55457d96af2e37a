"""/batch bodies read by `atropos-sft-gen --api-url`: lengths, ids and values without parsing token lists up front."""

from __future__ import annotations

import json
import random

import httpx
import orjson
import pyarrow as pa
import pytest

from environments.groups import MASK_IGNORE
from factory.export.config import SourceConfig
from factory.export.source import (
    SourceError,
    _numpy,
    group_from_wire,
    groups_from_batch_json,
    groups_from_batch_response,
    iter_api_groups,
)
from factory.schema import ARROW_STREAM, groups_to_record_batch
from factory.synthetic import synthetic_groups


def _random_batch(count: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    batch = []
    for index in range(count):
        size = rng.randint(0, 4)
        tokens = [[rng.randint(0, 2**31 - 1) for _ in range(rng.randint(0, 20))] for _ in range(size)]
        masks = [[rng.choice([MASK_IGNORE, token]) for token in sequence] for sequence in tokens]
        batch.append({
            "tokens": tokens, "masks": masks, "scores": [rng.uniform(-1, 1) for _ in range(size)],
            "env_id": rng.choice([None, 0, 3]),
            "messages": [[{"role": "user", "content": f"q{index}"}]] * size if index % 2 else None,
        })
    return batch


@pytest.mark.parametrize("dumps", [orjson.dumps, lambda value: json.dumps(value).encode(),
                                   lambda value: json.dumps(value, indent=2).encode()],
                         ids=["compact", "atropos-spaces", "indented"])
def test_fast_read_matches_the_slow_read(dumps):
    batch = _random_batch(200)
    fast = groups_from_batch_json(dumps({"batch": batch}))
    assert fast is not None and len(fast) == len(batch)
    for data, group in zip(batch, fast):
        slow = group_from_wire(orjson.loads(orjson.dumps(data)))
        assert group.group_id == slow.group_id  # content ids do not depend on how the server spaced its JSON
        assert group.seq_lens == slow.seq_lens
        assert group.completion_lens == slow.completion_lens
        assert group.scores == slow.scores and group.env == slow.env
        assert group.messages == slow.messages
        for index in range(len(data["tokens"])):
            assert group.tokens(index) == data["tokens"][index]
            assert group.masks(index) == data["masks"][index]


def test_metadata_given_by_the_server_is_used():
    body = orjson.dumps({"batch": [{"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1], "group_id": "g-1",
                                    "env": "math", "run_id": "r", "item_key": "k"}]})
    (group,) = groups_from_batch_json(body)
    assert (group.group_id, group.env, group.run_id, group.item_key) == ("g-1", "math", "r", "k")
    assert group.seq_lens == [2] and group.completion_lens == [1]


def test_loose_numbers_take_the_slow_way_with_the_same_answer():
    body = b'{"batch":[{"tokens":[[1.0,2,-0]],"masks":[[-100,2,0]],"scores":["0.5"]}]}'
    (group,) = groups_from_batch_json(body)
    slow = group_from_wire({**orjson.loads(body)["batch"][0], "scores": [0.5]})
    assert group.seq_lens == [3] and group.completion_lens == [2] and group.scores == [0.5]
    assert group.group_id == slow.group_id and group.tokens(0) == [1.0, 2, 0]


def test_empty_and_null_batches_and_garbage():
    assert groups_from_batch_json(b'{"batch":null}') is None
    assert groups_from_batch_json(b'{"status":"error","message":"Trainer not registered.","batch":[]}') == []
    with pytest.raises(SourceError, match="not an Atropos batch"):
        groups_from_batch_json(b"<html>")


def _arrow_stream(groups) -> bytes:
    batch = groups_to_record_batch(groups).select(["group_id", "run_id", "env", "item_key", "scores", "messages",
                                                    "images", "tokens", "masks"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_the_response_content_type_picks_the_reader():
    groups = list(synthetic_groups(3, group_size=2, seq_len=6, run_id="r"))
    arrow = groups_from_batch_response(httpx.Response(200, content=_arrow_stream(groups), headers={"content-type": ARROW_STREAM}))
    assert [(g.group_id, g.env, g.run_id, g.item_key) for g in arrow] == [(g.group_id, g.env, "r", g.item_key) for g in groups]
    assert [g.tokens(1) for g in arrow] == [g.tokens[1] for g in groups]
    plain = httpx.Response(200, content=b'{"batch":null}', headers={"content-type": "application/json"})
    assert groups_from_batch_response(plain) is None
    with pytest.raises(SourceError, match="Arrow stream"):
        groups_from_batch_response(httpx.Response(200, content=b"nonsense", headers={"content-type": ARROW_STREAM}))


@pytest.mark.parametrize("arrow", [True, False])
def test_api_source_asks_for_arrow_unless_told_not_to_and_filters_envs_alike(arrow):
    groups = list(synthetic_groups(4, group_size=2, seq_len=6, run_id="r"))
    groups[1].env = groups[3].env = "other"
    wire = [{**g.wire_dict(), "group_id": g.group_id, "env": g.env} for g in groups]
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/batch":
            return httpx.Response(200, json={"uuid": 1})
        seen.append(request.headers)
        if len(seen) > 1:
            return httpx.Response(200, json={"batch": None})
        if "arrow" in request.headers.get("accept", ""):
            return httpx.Response(200, content=_arrow_stream(groups), headers={"content-type": ARROW_STREAM})
        return httpx.Response(200, content=orjson.dumps({"batch": wire}), headers={"content-type": "application/json"})

    config = SourceConfig(api_url="http://127.0.0.1:9", envs=[groups[0].env], api_arrow=arrow, api_idle_timeout_s=0.01,
                          api_poll_s=0.01)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        got = list(iter_api_groups(config, client))
    assert [g.group_id for g in got] == [groups[0].group_id, groups[2].group_id]
    assert ("arrow" in seen[0].get("accept", "")) is arrow and seen[0]["accept-encoding"] == "identity"
    assert {g.run_id for g in got} == ({"r"} if arrow else {""})


@pytest.mark.parametrize("array", [
    pa.array([3, None, 5], pa.int32()),
    pa.array(range(10), pa.int64()).slice(4, 3),
    pa.array([], pa.int32()),
    pa.array([7, 8, 9], pa.int32()).slice(3),
])
def test_int_arrays_read_as_numpy_without_pandas(array):
    assert _numpy(array).tolist() == [0 if v is None else v for v in array.to_pylist()]
