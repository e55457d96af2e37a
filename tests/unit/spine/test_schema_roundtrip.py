"""model -> Arrow -> Parquet -> model is lossless, over generated groups."""

from __future__ import annotations

import io
from datetime import timezone

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from environments.groups import ScoredGroup
from factory.schema import GROUP_SCHEMA, groups_to_record_batch, record_batch_to_groups

finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=20)  # any unicode, including surrogate-free astral characters
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3),
    max_leaves=8,
)


@st.composite
def groups(draw) -> ScoredGroup:
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    size = len(lengths)

    def per_token(element):
        return [draw(st.lists(element, min_size=n, max_size=n)) for n in lengths]

    def optional(make):
        return None if draw(st.booleans()) else make()

    k = draw(st.integers(0, 2))
    return ScoredGroup(
        tokens=per_token(st.integers(0, 2**31 - 1)),
        masks=per_token(st.integers(-100, 2**31 - 1)),
        scores=draw(st.lists(finite, min_size=size, max_size=size)),
        advantages=optional(lambda: per_token(finite)),
        ref_logprobs=optional(lambda: per_token(finite)),
        inference_logprobs=optional(lambda: per_token(finite)),
        messages=optional(
            lambda: [
                draw(st.lists(st.fixed_dictionaries({"role": text, "content": text}, optional={"reward": finite}), max_size=3))
                for _ in lengths
            ]
        ),
        generation_params=optional(lambda: draw(st.dictionaries(text, json_value, max_size=3))),
        overrides=optional(lambda: [draw(st.dictionaries(text, json_value, max_size=2)) for _ in lengths]),
        group_overrides=optional(lambda: draw(st.dictionaries(text, json_value, max_size=2))),
        images=optional(lambda: draw(json_value)),
        env_id=optional(lambda: draw(st.integers(0, 2**40))),
        distill_token_ids=None if k == 0 else [[[draw(st.integers(0, 9)) for _ in range(k)] for _ in range(n)] for n in lengths],
        distill_logprobs=None if k == 0 else [[[draw(finite) for _ in range(k)] for _ in range(n)] for n in lengths],
        env=draw(text),
        item_key=draw(text),
        policy_version=draw(st.integers(0, 2**40)),
        run_id=draw(text),
        created_at=draw(st.datetimes(timezones=st.just(timezone.utc))),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(groups(), min_size=1, max_size=4))
def test_round_trip_through_parquet_is_lossless(original: list[ScoredGroup]):
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_batches([groups_to_record_batch(original)]), buffer, compression="zstd")
    table = pq.read_table(io.BytesIO(buffer.getvalue()))
    assert table.schema.equals(GROUP_SCHEMA, check_metadata=False)
    restored = list(record_batch_to_groups(table, validate=True))
    assert [g.model_dump() for g in restored] == [g.model_dump() for g in original]
