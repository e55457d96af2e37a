"""The native number reader and the ingest path built on it: the same values and answers as the general path."""

from __future__ import annotations

import math
import random
import struct

import msgspec
import orjson
import pyarrow as pa
import pytest

from bench.serve.run import make_groups
from factory.serve import numjson
from factory.serve.wire import DeferredRows, WireError, decode_groups, rows_table, stamp

pytestmark = pytest.mark.skipif(not numjson.available(), reason="no C compiler on this machine")

FLOATS = msgspec.json.Decoder(list[list[float]], strict=False)


@pytest.fixture
def general_path(monkeypatch):
    """Decode with the pure-Python path, as a machine without a C compiler does."""

    def use(enabled: bool) -> None:
        monkeypatch.setattr(numjson, "_library", numjson._get() if enabled else None)

    return use


def read_2d(text: bytes, integers: bool):
    """The field's (values, lengths) as numjson reads it inside a body, or None if it leaves it (or the body)."""
    name = b"tokens" if integers else b"inference_logprobs"
    read = numjson.read_body(b'{"%s": %s}' % (name, text), False)
    return None if read is None else read[1][0].get(name.decode())


@pytest.mark.parametrize(
    ("text", "values", "lengths"),
    [
        (b"[[1,2,3],[4]]", [1, 2, 3, 4], [3, 1]),
        (b" [ [ -100 , 7 ] ,\n [ ] , [0] ] ", [-100, 7, 0], [2, 0, 1]),
        (b"[]", [], []),
        (b"[[2147483647,-2147483648,-0]]", [2147483647, -2147483648, 0], [3]),
    ],
)
def test_integer_lists_are_read(text, values, lengths):
    read = read_2d(text, True)
    assert read is not None and read[0].tolist() == values and read[1].tolist() == lengths


@pytest.mark.parametrize(
    "text",
    [b"[[2147483648]]", b"[[-2147483649]]", b"[[1.0]]", b"[[1e2]]", b"[[01]]", b'[["3"]]', b"[[null]]", b"[[[1]]]",
     b"[1,2]", b"[[1,]]", b"[[1],]", b"[[1]] x", b"[[1]", b"", b"null", b"[[-]]", b"[[+1]]"],
)
def test_anything_but_plain_int32_lists_is_left_to_the_general_path(text):
    assert read_2d(text, True) is None


def _random_floats(rng: random.Random, count: int) -> list[str]:
    """Number texts as JSON writers make them: shortest reprs across magnitudes, float32 values widened, integers,
    exponents, and hand-picked edge cases."""
    texts = ["0", "-0", "0.0", "-0.0", "1", "-1", "1.0", "1e5", "1E+2", "2.5e-3", "123456789012345678901234567890",
             "9007199254740993", "0.1", "1e-290", "1.7976931348623157e290", "4.35", "0.000001", "-1.2618435545998652"]
    while len(texts) < count:
        kind = rng.randrange(5)
        if kind == 0:
            texts.append(repr(-rng.random() * 10))
        elif kind == 1:
            texts.append(repr(struct.unpack("f", struct.pack("f", -rng.random() * 20))[0]))
        elif kind == 2:
            texts.append(repr(rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)))
        elif kind == 3:
            texts.append(str(rng.randint(-10**20, 10**20)))
        else:
            texts.append(f"{rng.uniform(-10, 10):.{rng.randint(0, 20)}e}")
    return texts


def test_floats_are_bit_identical_to_msgspec():
    texts = _random_floats(random.Random(7), 20000)
    text = ("[[" + ",".join(texts[:7000]) + "],[],[" + ", ".join(texts[7000:]) + "]]").encode()
    read = read_2d(text, False)
    assert read is not None
    expected = [value for row in FLOATS.decode(text) for value in row]
    got = read[0].tolist()
    assert read[1].tolist() == [7000, 0, len(texts) - 7000]
    assert [struct.pack("d", v) for v in got] == [struct.pack("d", v) for v in expected]
    assert math.copysign(1.0, got[texts.index("-0")]) == 1.0 and math.copysign(1.0, got[texts.index("-0.0")]) == -1.0


@pytest.mark.parametrize("text", [b"[[1e400]]", b"[[1e-400]]", b"[[1e291]]", b"[[NaN]]", b"[[Infinity]]", b"[[.5]]",
                                  b"[[1.]]", b"[[1e]]", b'[["1.5"]]', b"[[1.5,null]]"])
def test_float_texts_outside_the_plain_range_are_left_to_the_general_path(text):
    assert read_2d(text, False) is None


def _bodies() -> list[tuple[bytes, bool]]:
    base = {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1.0, 0.0]}
    loose = [
        {**base, "messages": [[{"role": "user", "content": "x"}], [{"role": "user", "content": 7}]]},
        {**base, "advantages": [[0.5]], "ref_logprobs": [[-1.0, -2.0]], "inference_logprobs": [[1.0], [1, 2.5, 3e-2]]},
        {**base, "advantages": None, "inference_logprobs": [[-0.5, -1.5, -0.25], [-2.0, -0.125]], "env_id": 3},
        {**base, "group_overrides": {"sft": True}, "overrides": [{"sft": True}, {}], "group_id": "given", "item_key": "k"},
        {**base, "tokens": [[1, 2, 3], []], "masks": [[1], []], "policy_version": 4, "env": "named"},
        {**base, "scores": [1, "0.5"]},
        {**base, "tokens": [["1", 2, 3], [4, 5]]},  # lax strings: the general path takes them
        {**base, "inference_logprobs": [[1e400]]},  # out of range: the general path refuses it
        {**base, "tokens": []},
        {**base, "masks": [[2**40]]},
    ]
    bodies = [(orjson.dumps(body), False) for body in loose]
    bodies += [(b'{"tokens": [[1, 2], [3]], "masks" : [[1,2],[3]],\n "scores": [0.5, 1]}', False)]
    bodies += [(orjson.dumps(make_groups(1)[0]), False), (orjson.dumps(make_groups(5, start=3)), True)]
    bodies += [(orjson.dumps(loose[:5]), True), (orjson.dumps([loose[0], loose[7]]), True)]
    bodies += [(body, False) for body in _ODD_BODIES] + [(b"[]", True), (b'[{"tokens": [[1]], "masks": [[1]], "scores": [1]}, 3]', True)]
    return bodies


_ODD_BODIES = [
    # the number lists found among other keys whose values hold brackets, quotes, escapes and literals
    b'{"env": "a\\\"]}[", "tokens": [[1, 2]], "generation_params": {"tokens": [[9]], "x": [true, false, null, -1.5e3]},'
    b' "masks": [[1, 2]], "scores": [1.0], "messages": [[{"role": "user", "content": "[[1]]"}]]}',
    b' { "tokens" : [ [ 1 , 2 ] , [ ] ] , "masks" : [[1, 2], []] , "scores" : [ 1 , 0 ] } ',
    b'{"tok\u0065ns": [[1, 2]], "masks": [[1, 2]], "scores": [1]}',  # an escaped key: the general path reads it
    b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1], "tokens": [[3]]}',  # a repeated key
    b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1], "advantages": null, "ref_logprobs": []}',
    b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1]} trailing',  # not JSON: refused by both
    b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1], "env": "unterminated}',
]


def test_whole_bodies_are_read_in_one_pass():
    body = orjson.dumps(make_groups(2))
    stripped, fields = numjson.read_body(body, True)
    assert len(fields) == 2 and set(fields[0]) == {"tokens", "masks", "inference_logprobs"}
    assert orjson.loads(stripped)[0]["tokens"] == [] and len(stripped) < len(body) // 10
    values, lengths = fields[1]["tokens"]
    assert values.tolist() == [t for seq in make_groups(2)[1]["tokens"] for t in seq] and lengths.tolist() == [len(seq) for seq in make_groups(2)[1]["tokens"]]
    assert numjson.read_body(_ODD_BODIES[0], False)[1][0].keys() == {"tokens", "masks"}  # not generation_params' tokens
    for body in _ODD_BODIES[2:4]:  # left to the general path
        assert numjson.read_body(body, False) is None


def _decoded(body: bytes, many: bool, *, strict: bool = False, defer: bool = False):
    try:
        parsed = decode_groups(body, many=many, strict=strict, build=True, run_id="api", idempotency_key=None, defer=defer)
    except WireError as error:
        return ("refused", error.detail)
    rows = rows_table([parsed.rows]) if isinstance(parsed.rows, DeferredRows) else parsed.rows
    rows = rows.drop_columns(["created_at"])
    ids = [i if known else "fresh" for i, known in zip(parsed.ids, parsed.identified)]
    rows = rows.drop_columns(["group_id"])
    return (rows.to_pylist(), ids, dict(parsed.unaligned), parsed.unaligned_by_group, parsed.sizes, parsed.env_ids,
            parsed.envs, parsed.versions)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("body", "many"), _bodies())
def test_native_ingest_gives_what_the_general_path_gives(general_path, body, many, strict):
    general_path(False)
    expected = _decoded(body, many, strict=strict)
    general_path(True)
    assert _decoded(body, many, strict=strict) == expected
    assert _decoded(body, many, strict=strict, defer=True) == expected


def test_rows_built_per_commit_are_the_rows_built_per_post():
    """DeferredRows (small posts, built once per commit by rows_table) give the rows each post would have been built
    into, in order, also around posts built already and after the service's stamp of env names and versions."""
    groups = make_groups(7)
    groups[1]["env"], groups[2]["policy_version"], groups[3]["item_key"] = "named", 3, "k3"
    groups[4]["inference_logprobs"] = None
    groups[5]["messages"] = None
    bodies = [orjson.dumps(groups[0]), orjson.dumps(groups[1:3]), orjson.dumps(groups[3]), orjson.dumps(groups[4:7])]
    options = dict(build=True, run_id="api", idempotency_key=None, env_name=lambda env_id: "resolved", version=2)
    eager = [decode_groups(body, many=i % 2 == 1, **options) for i, body in enumerate(bodies)]
    deferred = [decode_groups(body, many=i % 2 == 1, defer=True, **options) for i, body in enumerate(bodies)]
    assert [type(p.rows) for p in deferred] == [DeferredRows] * 4
    parts = [deferred[0].rows, deferred[1].rows, eager[2].rows, stamp(deferred[3].rows, [0, 2], ["x", "y"], [5, 6])]
    expected = [eager[0].rows, eager[1].rows, eager[2].rows, stamp(eager[3].rows, [0, 2], ["x", "y"], [5, 6])]

    def comparable(table):
        return table.drop_columns(["created_at", "group_id"]).to_pylist()

    built = rows_table(parts)
    assert built.num_rows == 6 == sum(part.num_rows for part in parts)
    assert comparable(built) == comparable(pa.Table.from_batches(expected))
    ids = [*deferred[0].ids, *deferred[1].ids, *eager[2].ids, deferred[3].ids[0], deferred[3].ids[2]]
    assert built.column("group_id").to_pylist() == ids


def test_posts_that_could_fail_a_shared_build_are_built_at_once():
    """A post whose rows might not build (distillation fields; an integer outside int64) is built in its own
    thread as before, so that its problem is its own 422 and never a failed commit of other posts."""
    group = make_groups(1)[0]
    options = dict(build=True, run_id="api", defer=True)
    assert isinstance(decode_groups(orjson.dumps(group), many=False, **options).rows, DeferredRows)
    distilled = {**group, "distill_token_ids": [[[1]] * len(seq) for seq in group["tokens"]],
                 "distill_logprobs": [[[-0.5]] * len(seq) for seq in group["tokens"]]}
    assert isinstance(decode_groups(orjson.dumps(distilled), many=False, **options).rows, pa.RecordBatch)
    huge = {**group, "policy_version": 1 << 63}
    parsed = _decoded(orjson.dumps(huge), False, defer=True)
    assert parsed == _decoded(orjson.dumps(huge), False)
    assert isinstance(decode_groups(orjson.dumps(make_groups(8)), many=True, **options).rows, pa.RecordBatch)


def test_without_the_library_ingest_still_works(general_path):
    general_path(False)
    assert not numjson.available()
    parsed = decode_groups(orjson.dumps(make_groups(1)[0]), many=False, build=True, run_id="api")
    assert parsed.rows.num_rows == 1


def test_big_bodies_read_through_kept_buffers_give_what_fresh_ones_give(monkeypatch):
    monkeypatch.setattr(numjson, "SCRATCH_MIN_BYTES", 1)
    numjson.drop_scratch()
    bodies = [orjson.dumps(make_groups(3, start=5)), orjson.dumps(make_groups(1)), orjson.dumps(make_groups(2, start=9))]
    kept = [numjson.read_body(bytearray(body), True) for body in bodies]  # a buffer, as a pooled post body is
    assert numjson._scratch is not None
    numjson.drop_scratch()
    monkeypatch.setattr(numjson, "SCRATCH_MIN_BYTES", 1 << 40)
    fresh = [numjson.read_body(body, True) for body in bodies]
    for (stripped, fields), (stripped2, fields2) in zip(kept, fresh):
        assert stripped == stripped2 and len(fields) == len(fields2)
        for mine, theirs in zip(fields, fields2):
            assert mine.keys() == theirs.keys()
            for name in mine:
                assert all((a == b).all() for a, b in zip(mine[name], theirs[name]))
    assert numjson._scratch is None


def test_a_view_of_a_buffer_decodes_as_its_bytes_on_both_paths(general_path):
    body = orjson.dumps(make_groups(2))
    view = memoryview(bytearray(body) + b"tail")[: len(body)]
    for native in (True, False):
        general_path(native)
        assert _decoded(view, True) == _decoded(body, True)
