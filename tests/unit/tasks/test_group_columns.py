"""A chunk grouped as columns (factory/group_columns.GroupColumns) writes the rows the ScoredGroup path wrote.

The reference is the path as it was: `build_group` (a validated ScoredGroup per item) and
`groups_to_record_batch` on those groups; every test compares against it, column by column and, for the
store, byte for byte.
"""

from __future__ import annotations

import json
import math
import pickle
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from environments.base import Item, Rollout
from environments.groups import ScoredGroup
from factory import group_columns
from factory.group_columns import GroupColumns, one_reply_messages_json
from factory.schema import groups_to_record_batch
from factory.store import ShardStore
from tasks.group import GroupedChunk, build_group, group_chunk

OPTIONS = {"group_size": 3, "max_token_length": 40, "run_id": "run", "seed": 7}


@pytest.fixture(autouse=True, params=["native", "python"])
def sequences_path(request, monkeypatch):
    """Every test here runs with group_arrays.c (where it was built) and with the Python path it stands in for."""
    if request.param == "python":
        monkeypatch.setattr(group_columns, "_native", None)
    elif group_columns._native is None:
        pytest.skip("factory/group_arrays.c was not built (no C compiler at install time)")


def make_item(index: int, *, images: object = None, difficulty: object = None) -> Item:
    info: dict = {"index": index}
    if images is not None:
        info["images"] = images
    if difficulty is not None:
        info["difficulty"] = difficulty
    return Item(key=f"k:{index}", messages=[{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": f"Compute {index}+1 — ünïcode"}], info=info)


def make_rollouts(item: Item, rng: random.Random, *, shared_prompt: bool = True, logprobs: bool = True,
                  multi_turn: bool = False) -> list[Rollout]:
    prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 8))]
    rollouts = []
    for choice in range(OPTIONS["group_size"]):
        output = [rng.randrange(0, 500) for _ in range(rng.randrange(1, 9))]
        r = Rollout(item.key, f"answer {choice} «{rng.random()}»", prompt if shared_prompt else list(prompt), output,
                    [rng.uniform(-3, 0) for _ in output] if logprobs else None, "stop", rng.randrange(0, 3),
                    score=rng.choice([0.0, 0.5, 1.0, -1.0]))
        if multi_turn:
            r.output_mask = [rng.random() < 0.6 for _ in output]
            r.messages = [*item.messages, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": r.text}]
        rollouts.append(r)
    return rollouts


def reference(items: list[Item], rollouts: list[list[Rollout]], **options) -> list[ScoredGroup]:
    built = [build_group("env", item, group, **{**OPTIONS, **options}) for item, group in zip(items, rollouts)]
    return [group for group in built if not isinstance(group, str)]


def without_created_at(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.drop_columns(["created_at"])


def dumped(group: ScoredGroup) -> dict:
    return group.model_dump(exclude={"created_at"})


def chunk(rng: random.Random, count: int = 12, **kinds) -> tuple[list[Item], list[list[Rollout]]]:
    items = [make_item(i, **{k: v for k, v in kinds.items() if k in ("images", "difficulty")}) for i in range(count)]
    rollouts = [make_rollouts(item, rng, **{k: v for k, v in kinds.items() if k not in ("images", "difficulty")})
                for item in items]
    return items, rollouts


@pytest.mark.parametrize("kinds", [
    {},
    {"shared_prompt": False},
    {"logprobs": False},
    {"multi_turn": True},
    {"multi_turn": True, "logprobs": False},
    {"images": [{"url": "data:x"}], "difficulty": 3},
])
def test_columns_write_the_rows_and_groups_of_the_scoredgroup_path(kinds):
    rng = random.Random(len(repr(kinds)))
    items, rollouts = chunk(rng, **kinds)
    grouped = group_chunk("env", items, rollouts, **OPTIONS, generation_params={"temperature": 1.0, "n": 3})
    expected = reference(items, rollouts, generation_params={"temperature": 1.0, "n": 3})
    assert isinstance(grouped.groups, GroupColumns)
    assert len(grouped.groups) == len(expected) > 0
    assert without_created_at(grouped.to_record_batch()).equals(without_created_at(groups_to_record_batch(expected)))
    assert [dumped(g) for g in grouped.groups] == [dumped(g) for g in expected]
    assert grouped.groups[-1].group_id == expected[-1].group_id
    assert sum(grouped.dropped.values()) + len(grouped.groups) == len(items)


def test_groups_with_and_without_logprobs_in_one_chunk():
    rng = random.Random(3)
    items, rollouts = chunk(rng, 10)
    for group in rollouts[::3]:
        group[1].output_logprobs = None  # that group has no inference_logprobs
    grouped = group_chunk("env", items, rollouts, **OPTIONS)
    expected = reference(items, rollouts)
    assert isinstance(grouped.groups, GroupColumns)
    batch = grouped.to_record_batch()
    assert batch.column("inference_logprobs").null_count == len([g for g in expected if g.inference_logprobs is None]) > 0
    assert without_created_at(batch).equals(without_created_at(groups_to_record_batch(expected)))
    assert [dumped(g) for g in grouped.groups] == [dumped(g) for g in expected]


def test_drops_and_an_empty_chunk():
    rng = random.Random(5)
    items, rollouts = chunk(rng, 4)
    rollouts[0][0].error = "generate_error: x"
    rollouts[1] = rollouts[1][:2]
    rollouts[2][0].output_token_ids = list(range(60))  # too long
    for r in rollouts[3]:
        r.score = 1.0
    grouped = group_chunk("env", items, rollouts, **OPTIONS)
    assert dict(grouped.dropped) == {"failed": 1, "wrong_size": 1, "too_long": 1, "equal_scores": 1}
    assert grouped.groups == [] and len(grouped) == 0
    assert without_created_at(grouped.to_record_batch()).equals(without_created_at(groups_to_record_batch([])))
    empty = group_chunk("env", [], [], **OPTIONS)
    assert empty.to_record_batch().num_rows == 0


def test_ids_the_arrays_cannot_hold_fall_back_to_scoredgroups():
    rng = random.Random(11)
    items, rollouts = chunk(rng, 6)
    rollouts[2][1].output_token_ids = [5.0, 6.0]  # pydantic coerces these: the rest of the chunk goes its way
    grouped = group_chunk("env", items, rollouts, **OPTIONS)
    expected = reference(items, rollouts)
    assert isinstance(grouped.groups, list) and all(isinstance(g, ScoredGroup) for g in grouped.groups)
    assert without_created_at(grouped.to_record_batch()).equals(without_created_at(groups_to_record_batch(expected)))

    items, rollouts = chunk(rng, 3)
    rollouts[1][0].output_token_ids = [2**31]  # a valid ScoredGroup that Arrow's int32 refuses, at commit as before
    grouped = group_chunk("env", items, rollouts, **OPTIONS)
    with pytest.raises(pa.ArrowInvalid):
        grouped.to_record_batch()


@pytest.mark.parametrize("spoil", ["nan_score", "short_mask", "message_without_role"])
def test_a_bad_group_raises_what_scoredgroup_raised(spoil):
    rng = random.Random(13)
    items, rollouts = chunk(rng, 3, multi_turn=(spoil == "short_mask"))
    if spoil == "nan_score":
        rollouts[1][2].score = math.nan
    elif spoil == "short_mask":
        rollouts[1][2].output_mask = rollouts[1][2].output_mask[:-1] if len(rollouts[1][2].output_token_ids) > 1 else []
    else:
        items[1] = Item(key=items[1].key, messages=[{"content": "no role"}], info=items[1].info)
    with pytest.raises(ValidationError) as before:
        reference(items, rollouts)
    with pytest.raises(ValidationError) as now:
        group_chunk("env", items, rollouts, **OPTIONS)
    assert str(now.value) == str(before.value)


def test_slices_trim_the_rows_and_pickle_keeps_them():
    rng = random.Random(17)
    items, rollouts = chunk(rng, 9)
    grouped = group_chunk("env", items, rollouts, **OPTIONS)
    full = grouped.to_record_batch()
    kept = len(grouped.groups)
    for need in (0, 1, kept - 1):
        trimmed = grouped.groups[:need]
        assert isinstance(trimmed, GroupColumns) and len(trimmed) == need
        assert trimmed.to_record_batch().equals(full.slice(0, need))
    middle = grouped.groups[1:kept - 1]
    assert middle.to_record_batch().equals(full.slice(1, kept - 2))
    assert grouped.groups[::2].to_record_batch().equals(pa.concat_batches([full.slice(i, 1) for i in range(0, kept, 2)]))
    assert [dumped(g) for g in grouped.groups[-2:]] == [dumped(g) for g in list(grouped.groups)[-2:]]
    again = pickle.loads(pickle.dumps(grouped))
    assert again.to_record_batch().equals(full)
    with pytest.raises(IndexError):
        grouped.groups[kept]


def test_the_shard_is_byte_for_byte_the_scoredgroup_paths(tmp_path):
    rng = random.Random(19)
    items, rollouts = chunk(rng, 300)  # more than one row group of 256
    grouped = group_chunk("env", items, rollouts, **OPTIONS, generation_params={"temperature": 0.5})
    same_groups = list(grouped.groups)  # ScoredGroups, created_at included
    assert len(same_groups) > 256
    columns_store, groups_store = ShardStore(tmp_path / "columns"), ShardStore(tmp_path / "groups")
    written = columns_store.commit("run", "p", 0, grouped)
    before = groups_store.commit("run", "p", 0, same_groups)
    assert (written.rows, written.bytes, written.sha256, written.index) == (before.rows, before.bytes, before.sha256,
                                                                           before.index)
    assert columns_store.shard_path("run", written.shard).read_bytes() == groups_store.shard_path("run", before.shard).read_bytes()
    metadata = pq.ParquetFile(columns_store.shard_path("run", written.shard)).metadata  # the commit's row groups of 256
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [256, len(same_groups) - 256]
    assert columns_store.commit("run", "p", 0, grouped).skipped
    empty = group_chunk("env", [], [], **OPTIONS)
    assert columns_store.commit("run", "p", 1, empty).sha256 == groups_store.commit("run", "p", 1, []).sha256


def test_grouped_chunk_of_scoredgroups_still_commits(tmp_path):
    rng = random.Random(23)
    items, rollouts = chunk(rng, 5)
    expected = reference(items, rollouts)
    record = ShardStore(tmp_path).commit("run", "p", 0, GroupedChunk(list(expected)))
    assert record.rows == len(expected)
    rows = ShardStore(tmp_path).dataset("run").to_table().to_pylist()
    assert [r["group_id"] for r in rows] == [g.group_id for g in expected]


def test_add_refuses_what_scoredgroup_would_change_and_leaves_the_columns_as_they_were():
    columns = GroupColumns()
    good = {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0], "group_id": "g", "env": "e", "item_key": "k",
            "policy_version": 0, "run_id": "r", "messages": [[{"role": "user", "content": "x"}]]}
    assert columns.add(**good)
    for spoiled in ({"tokens": [[1, 2.5]]}, {"tokens": [[1, 2**40]]}, {"masks": [[1]]}, {"scores": [math.inf]},
                    {"scores": [1]}, {"policy_version": -1}, {"difficulty": "3"}, {"group_id": ""},
                    {"messages": [[{1: "x", "role": "u", "content": "c"}]]}, {"generation_params": {1: 2}},
                    {"images": [math.nan]}, {"inference_logprobs": [[0.0]]}, {"tokens": [[]], "masks": [[]]}):
        assert not columns.add(**{**good, **spoiled}), spoiled
    assert len(columns) == 1 and list(columns.tokens) == [1, 2] and list(columns.masks) == [-100, 2]
    assert columns[0].tokens == [[1, 2]] and columns[0].messages == good["messages"]


message = st.fixed_dictionaries(
    {"role": st.text(max_size=8), "content": st.one_of(st.text(), st.lists(st.dictionaries(st.text(max_size=4), st.text())))},
    optional={"name": st.text(max_size=4), "score": st.floats(allow_nan=False, allow_infinity=False)})


@settings(max_examples=200, deadline=None)
@given(st.lists(message, max_size=3), st.lists(st.text(), min_size=1, max_size=4))
def test_one_reply_messages_json_is_json_dumps_of_the_conversations(prompt, replies):
    conversations = [[*prompt, {"role": "assistant", "content": reply}] for reply in replies]
    assert one_reply_messages_json(prompt, replies) == json.dumps(conversations, ensure_ascii=False, allow_nan=False)


def test_one_reply_messages_json_refuses_what_scoredgroup_or_json_would_not_keep():
    for prompt in ([{"content": "no role"}], [{"role": "u", "content": "c", 1: "int key"}], ["not a dict"],
                   [{"role": "u", "content": math.nan}]):
        assert one_reply_messages_json(prompt, ["a"]) is None


def _spoiled_chunk(rng: random.Random) -> tuple[list[Item], list[list[Rollout]]]:
    """Shared prompts, with a group of each drop reason, one without logprobs and one whose prompt is a copy."""
    items, rollouts = chunk(rng, 14, difficulty=2)
    rollouts[0][1].error = "generate_error: x"
    rollouts[1] = rollouts[1][:2]
    rollouts[2][0].output_token_ids = list(range(60))
    for r in rollouts[3]:
        r.score = 0.5
    rollouts[4][2].output_logprobs = None
    rollouts[5][1].prompt_token_ids = list(rollouts[5][1].prompt_token_ids)
    rollouts[6][0].score = 1  # an int score: stored as the float ScoredGroup makes of it
    return items, rollouts


def test_shared_prompt_groups_skip_group_fields_and_count_as_the_general_path(monkeypatch):
    import tasks.group as grouping

    items, rollouts = _spoiled_chunk(random.Random(29))
    calls = []
    general = grouping.group_fields
    monkeypatch.setattr(grouping, "group_fields", lambda *a, **k: calls.append(a[1].key) or general(*a, **k))
    fast = group_chunk("env", items, rollouts, **OPTIONS, generation_params={"temperature": 0.5})
    assert calls == [items[0].key, items[5].key]  # the failed group and the one whose prompt is not shared
    monkeypatch.setattr(grouping, "_shared_prompt_group", lambda *a: None)
    slow = group_chunk("env", items, rollouts, **OPTIONS, generation_params={"temperature": 0.5})
    assert dict(fast.dropped) == dict(slow.dropped) == {"failed": 1, "wrong_size": 1, "too_long": 1, "equal_scores": 1}
    assert fast.stats() == slow.stats() and fast.outcomes == slow.outcomes
    assert without_created_at(fast.to_record_batch()).equals(without_created_at(slow.to_record_batch()))
    expected = reference(items, rollouts, generation_params={"temperature": 0.5})
    assert without_created_at(fast.to_record_batch()).equals(without_created_at(groups_to_record_batch(expected)))


def test_add_shared_prompt_refuses_what_add_refuses_and_leaves_the_columns_as_they_were():
    columns = GroupColumns()
    good = {"prompt": [7, 8], "outputs": [[1, 2], [3]], "logprobs": [[-0.5, -1.0], [-2.0]], "scores": [1.0, 0.0],
            "messages_json": "[]", "generation_params": None, "images": None, "group_id": "g", "env": "e",
            "item_key": "k", "policy_version": 0, "run_id": "r", "difficulty": None}
    assert columns.add_shared_prompt(**good)
    for spoiled in ({"outputs": [[1, 2.5], [3]]}, {"outputs": [[1, 2**40], [3]]}, {"scores": [math.inf, 0.0]},
                    {"scores": [1, 0.0]}, {"policy_version": -1}, {"difficulty": "3"}, {"group_id": ""},
                    {"generation_params": {1: 2}}, {"images": [math.nan]}, {"logprobs": [[-0.5, "x"], [-2.0]]},
                    {"prompt": []}, {"outputs": []}):
        assert not columns.add_shared_prompt(**{**good, **spoiled}), spoiled
    assert len(columns) == 1 and list(columns.tokens) == [7, 8, 1, 2, 7, 8, 3]
    assert list(columns.masks) == [-100, -100, 1, 2, -100, -100, 3]
    assert columns[0].inference_logprobs == [[1.0, 1.0, -0.5, -1.0], [1.0, 1.0, -2.0]]

