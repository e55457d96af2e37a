"""/batch bodies read by `atropos-sft-gen --api-url`: lengths, ids and values without parsing token lists up front."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from environments.groups import MASK_IGNORE
from factory.export.source import SourceError, group_from_wire, groups_from_batch_json


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
