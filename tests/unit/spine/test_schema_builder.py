"""The fast list<list<int32>> builder gives the same Arrow columns as pyarrow's nested conversion."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.schema import GROUP_SCHEMA, _int_2d, groups_to_record_batch

sequences = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6)
int_2d = st.lists(st.lists(sequences, max_size=4), max_size=5)  # empty groups and sequences included


@settings(max_examples=200, deadline=None)
@given(int_2d)
def test_fast_builder_equals_nested_conversion(columns):
    expected = pa.array(columns, type=pa.list_(pa.list_(pa.int32())))
    built = _int_2d(columns)
    assert built.type == expected.type
    assert built.equals(expected)
    assert built.to_pylist() == columns


def test_out_of_range_values_fail_as_before():
    for value in (2**31, -(2**31) - 1):
        with pytest.raises(pa.ArrowInvalid):
            pa.array([[[value]]], type=pa.list_(pa.list_(pa.int32())))
        with pytest.raises(pa.ArrowInvalid):
            _int_2d([[[value]]])


def test_record_batch_matches_nested_conversion_column_by_column():
    from environments.groups import ScoredGroup

    groups = [
        ScoredGroup(tokens=[[1, 2, 3], [4]], masks=[[-100, 2, 3], [4]], scores=[0.5, 1.0],
                    env="e", item_key=f"k{i}", run_id="r", policy_version=i)
        for i in range(3)
    ]
    batch = groups_to_record_batch(groups)
    assert batch.schema == GROUP_SCHEMA
    for name in ("tokens", "masks"):
        expected = pa.array([getattr(g, name) for g in groups], type=GROUP_SCHEMA.field(name).type)
        assert batch.column(name).equals(expected)


def _nested_conversion(groups) -> pa.RecordBatch:
    """The builder as it was: pa.array on each column's Python values."""
    from environments.groups import GROUP_META_FIELDS, GROUP_WIRE_FIELDS
    from factory.schema import JSON_FIELDS, _dump_json

    columns = {field.name: [] for field in GROUP_SCHEMA}
    for group in groups:
        for name in (*GROUP_WIRE_FIELDS, *GROUP_META_FIELDS):
            value = getattr(group, name)
            columns[name].append(_dump_json(name, value) if name in JSON_FIELDS else value)
        columns["group_size"].append(group.group_size)
    return pa.RecordBatch.from_arrays([pa.array(columns[f.name], type=f.type) for f in GROUP_SCHEMA], schema=GROUP_SCHEMA)


from tests.unit.spine.test_schema_roundtrip import groups as any_group  # noqa: E402


@settings(max_examples=150, deadline=None, suppress_health_check=list(__import__("hypothesis").HealthCheck))
@given(st.lists(any_group(), max_size=4))
def test_record_batch_equals_the_nested_conversion(groups):
    built, expected = groups_to_record_batch(groups), _nested_conversion(groups)
    assert built.schema == expected.schema
    for name in GROUP_SCHEMA.names:
        assert built.column(name).equals(expected.column(name)), name
    assert built.equals(expected)


def test_building_does_not_import_pandas():
    import subprocess
    import sys

    code = ("import sys; from tests.unit.spine.test_schema_builder import _sample; "
            "from factory.schema import groups_to_record_batch; groups_to_record_batch(_sample()); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _sample():
    from environments.groups import ScoredGroup

    return [ScoredGroup(tokens=[[1, 2], [3]], masks=[[-100, 2], [3]], scores=[0.5, 1.0], env="e", item_key="k",
                        run_id="r", policy_version=1, messages=[[{"role": "user", "content": "é"}], []])]


def test_timestamps_in_other_zones_and_naive_equal_pyarrows_reading():
    from datetime import datetime, timedelta, timezone

    from factory.schema import _column

    field = GROUP_SCHEMA.field("created_at")
    for values in (
        [datetime(2026, 11, 25, 10, 0, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30))),
         datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)],
        [datetime(2026, 11, 25, 10, 0, 0, 1)],
    ):
        assert _column(field, values).equals(pa.array(values, type=field.type))
