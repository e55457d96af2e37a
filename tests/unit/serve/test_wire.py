"""Posted bodies to Arrow rows: loose as Atropos, identity-only dedup, strict mode, verbatim JSON fields."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from factory.schema import record_batch_to_groups
from factory.serve.config import ServeConfig
from factory.serve.payload import batch_json, encode_groups
from factory.serve.service import BatchService
from factory.serve.wire import WireError, decode_groups, to_record_batch


def group(**extra) -> dict:
    return {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1.0, 0.0], **extra}


def rows(parsed, **kwargs):
    n = len(parsed.groups)
    return to_record_batch(parsed.groups, parsed.ids, run_id="api", envs=["e"] * n, versions=[0] * n, **kwargs)


def test_identical_groups_without_identity_get_distinct_ids():
    parsed = decode_groups(orjson.dumps([group(), group(), group()]), many=True)
    assert len(set(parsed.ids)) == 3 and parsed.identified == [False] * 3


def test_identity_from_group_id_or_idempotency_key():
    parsed = decode_groups(orjson.dumps([group(group_id="a"), group()]), many=True, idempotency_key="k")
    assert parsed.ids == ["a", "k:1"] and parsed.identified == [True, True]
    assert decode_groups(orjson.dumps(group()), many=False, idempotency_key="k").ids == ["k"]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"messages": None},
        {"messages": []},
        {"messages": [[{"role": "user", "content": ""}], [{"role": "assistant", "content": "  "}]]},
        {"messages": [[{"role": "user", "content": "42"}], [{"role": "user", "content": 7}]]},
        {"advantages": [[0.5]], "ref_logprobs": [[-1.0, -2.0]], "inference_logprobs": [[1.0], [1.0, 2.0, 3.0]]},
        {"overrides": [{"set_advantage_to_zero": True}]},
        {"group_overrides": {"sft": True}, "overrides": [{"sft": True}, {}]},
        {"scores": [1, "0.5"], "custom_key": {"ignored": True}},
        {"tokens": [[1, 2, 3], []], "masks": [[1], []]},
    ],
)
def test_bodies_atropos_takes_are_taken_and_stored_verbatim(extra):
    body = group(**extra)
    parsed = decode_groups(orjson.dumps(body), many=False)
    batch = rows(parsed)
    served = orjson.loads(batch_json(encode_groups(batch.select([*batch.schema.names]))))["batch"][0]
    for name in ("tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs", "messages", "overrides", "group_overrides"):
        if name in body:
            expected = body[name]
            if name == "scores":
                expected = [float(v) for v in expected]
            assert served[name] == expected, name
    assert served["scores"] == [float(v) for v in body["scores"]]
    assert list(record_batch_to_groups(batch))[0].tokens == body["tokens"]


def test_unaligned_fields_are_counted_or_refused_when_strict():
    body = orjson.dumps(group(advantages=[[0.5]], messages=[], overrides=[{}, {}]))
    assert dict(decode_groups(body, many=False).unaligned) == {"advantages": 1, "messages": 1}
    with pytest.raises(WireError) as error:
        decode_groups(body, many=False, strict=True)
    assert [d["loc"] for d in error.value.detail] == [["body", "advantages"], ["body", "messages"]]


@pytest.mark.parametrize(
    "body, loc",
    [
        (group(tokens=[["a"]]), ["body", "tokens", 0, 0]),
        (group(scores="high"), ["body", "scores"]),
        ({"masks": [[1]], "scores": [1.0]}, ["body", "tokens"]),
        (group(messages=[[{"role": "user"}], []]), ["body", "messages", 0, 0]),
        (group(tokens=[]), ["body", "tokens"]),
        (group(generation_params=[1]), ["body", "generation_params"]),
    ],
)
def test_what_atropos_refuses_is_a_422_naming_the_field(body, loc):
    with pytest.raises(WireError) as error:
        decode_groups(orjson.dumps(body), many=False)
    assert error.value.detail[0]["loc"] == loc, error.value.detail


def test_list_errors_name_the_index():
    with pytest.raises(WireError) as error:
        decode_groups(orjson.dumps([group(), group(scores=None)]), many=True)
    assert error.value.detail[0]["loc"][:2] == ["body", 1]


def test_service_stores_identical_groups_and_dedups_only_by_identity(tmp_path):
    async def scenario():
        service = BatchService(ServeConfig(store_root=str(tmp_path), follow_interval_s=0.05))
        await service.start()
        try:
            same = orjson.dumps([group(), group()])
            assert await service.ingest_wire(decode_groups(same, many=True)) == 2
            assert await service.ingest_wire(decode_groups(same, many=True)) == 2
            keyed = decode_groups(same, many=True, idempotency_key="retry-1")
            assert await service.ingest_wire(keyed) == 2
            # The retry of that request (a lost acknowledgement) stores nothing; concurrent duplicates neither.
            again = [decode_groups(same, many=True, idempotency_key="retry-1") for _ in range(3)]
            assert await asyncio.gather(*(service.ingest_wire(p) for p in again)) == [0, 0, 0]
            racing = [decode_groups(orjson.dumps(group(group_id="g7")), many=False) for _ in range(4)]
            assert sorted(await asyncio.gather(*(service.ingest_wire(p) for p in racing))) == [0, 0, 0, 1]
            assert service.status()["queue_size"] == 7
            unaligned = decode_groups(orjson.dumps(group(inference_logprobs=[[1.0]])), many=False)
            await service.ingest_wire(unaligned)
            assert service.status()["unaligned"]["inference_logprobs"] == 1
            assert sum(service.status()["ingested"].values()) == 8  # committed posted groups, by env name
        finally:
            await service.stop()
        restarted = BatchService(ServeConfig(store_root=str(tmp_path)))
        await restarted.start()
        try:
            assert restarted.status()["queue_size"] == 8
            assert restarted.status()["unaligned"]["inference_logprobs"] == 1
            assert sum(restarted.status()["ingested"].values()) == 8  # durable (flows/atropos_env.py polls it)
            assert await restarted.ingest_wire(decode_groups(orjson.dumps(group(group_id="g7")), many=False)) == 0
        finally:
            await restarted.stop()

    asyncio.run(scenario())


def test_prebuilt_rows_are_stamped_and_deduplicated(tmp_path):
    async def scenario():
        service = BatchService(ServeConfig(store_root=str(tmp_path), batch_metadata=True))
        await service.start()
        try:
            body = orjson.dumps([group(group_id="a"), group(env="mine", policy_version=3), group(group_id="a")])
            parsed = decode_groups(body, many=True, build=True, run_id="api")
            assert parsed.groups == [] and parsed.rows.num_rows == 3 and parsed.sizes == [2, 2, 2]
            assert await service.ingest_wire(parsed) == 2
            table = service.store.dataset("api").to_table(columns=["group_id", "env", "policy_version", "run_id"]).to_pylist()
            assert [(r["env"], r["policy_version"], r["run_id"]) for r in table] == [("external", 0, "api"), ("mine", 3, "api")]
            assert table[0]["group_id"] == "a"
        finally:
            await service.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "body, loc",
    [
        (orjson.dumps(group(scores=[1.0, "NaN"])), ["body", "scores", 1]),
        (orjson.dumps(group(scores=["nan", 0.0])), ["body", "scores", 0]),
        (orjson.dumps(group(scores=[1.0, "-Infinity"])), ["body", "scores", 1]),
        (orjson.dumps(group(scores=[1, "0.5"])), ["body", "scores", 1]),
        (b'{"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [NaN, 0.0]}', ["body", "scores"]),
        (b'{"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [Infinity, 0.0]}',
         ["body", "scores"]),
        (b'{"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1e999, 0.0]}',
         ["body", "scores", 0]),
        (orjson.dumps(group(tokens=[[1, 2, 3], [4, "5"]])), ["body", "tokens", 1, 1]),
        (orjson.dumps(group(tokens=[[1, 2.0, 3], [4, 5]])), ["body", "tokens", 0, 1]),
        (orjson.dumps(group(tokens=[[1, 2, 3], [4, -5]])), ["body", "tokens", 1, 1]),
        (orjson.dumps(group(tokens=[[1, 2, 3], [4, 5]], masks=[[-100, 2, 3], [-100, 5]], advantages=[[0.0, "NaN", 1.0],
                                                                                                  [1.0, 2.0]])),
         ["body", "advantages", 0, 1]),
        (orjson.dumps([group(), group(tokens=[[1, 2, 3], [-1, 5]])]), ["body", 1, "tokens", 1, 0]),
    ],
)
def test_strict_refuses_strings_nan_and_bad_token_ids_naming_the_field(body, loc):
    many = body.lstrip().startswith(b"[")
    with pytest.raises(WireError) as error:
        decode_groups(body, many=many, strict=True, build=True, run_id="api")
    assert [d["loc"] for d in error.value.detail][0] == loc, error.value.detail


def test_without_strict_strings_and_negative_ids_are_taken_as_atropos_takes_them():
    parsed = decode_groups(orjson.dumps(group(scores=[1.0, "NaN"], tokens=[[1, 2, 3], [4, -5]])), many=False, build=True)
    assert parsed.rows.num_rows == 1


def test_strict_bounds_token_ids_by_the_vocab_size():
    body = orjson.dumps(group(tokens=[[1, 2, 3], [4, 511]]))
    assert decode_groups(body, many=False, strict=True, build=True, vocab_size=512).rows.num_rows == 1
    with pytest.raises(WireError) as error:
        decode_groups(orjson.dumps(group(tokens=[[1, 512, 3], [4, 5]])), many=False, strict=True, vocab_size=512)
    assert error.value.detail[0]["loc"] == ["body", "tokens", 0, 1] and "vocab" in error.value.detail[0]["msg"]
