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
