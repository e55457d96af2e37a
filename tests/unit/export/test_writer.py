"""Outputs appear whole or not at all, are never overwritten by accident, and load with `datasets`."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.export.config import OutputConfig
from factory.export.writer import DatasetWriter, OutputExistsError

SCHEMA = pa.schema([pa.field("text", pa.string()), pa.field("score", pa.float64())])


def _write(path, rows, **output):
    writer = DatasetWriter(OutputConfig(path=str(path), **output), SCHEMA)
    for row in rows:
        writer.write(row)
    return writer.close()


def _rows(n, start=0):
    return [{"text": f"row {i}", "score": float(i)} for i in range(start, start + n)]


def _hidden(directory):
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_directory_output_rolls_shards_and_loads_with_datasets(tmp_path):
    paths = _write(tmp_path / "out", _rows(25), rows_per_shard=10)
    assert [p.name for p in paths] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    assert loaded["text"] == [f"row {i}" for i in range(25)]
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_single_file_outputs(tmp_path, name):
    [path] = _write(tmp_path / name, _rows(3))
    builder = "json" if name.endswith("jsonl") else "parquet"
    assert datasets.load_dataset(builder, data_files=str(path), split="train")["score"] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", ["out", "out.jsonl", "out.parquet"])
def test_existing_output_is_refused_unless_told(tmp_path, name):
    _write(tmp_path / name, _rows(2))
    with pytest.raises(OutputExistsError, match="--append-to-previous"):
        _write(tmp_path / name, _rows(2))
    _write(tmp_path / name, _rows(1, start=50), overwrite=True)
    _write(tmp_path / name, _rows(2, start=60), append=True)
    builder = "json" if name.endswith("jsonl") else "parquet"
    files = str(tmp_path / name) if "." in name else str(tmp_path / name / "*.parquet")
    loaded = datasets.load_dataset(builder, data_files=files, split="train")
    assert sorted(loaded["text"]) == ["row 50", "row 60", "row 61"]
    assert _hidden(tmp_path) == []


def test_append_to_a_directory_numbers_new_shards_after_the_old(tmp_path):
    _write(tmp_path / "out", _rows(4), rows_per_shard=2)
    paths = _write(tmp_path / "out", _rows(2, start=10), append=True, rows_per_shard=2)
    assert [p.name for p in paths] == ["part-00002.parquet"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"part-0000{i}.parquet" for i in range(3)]


def test_append_with_different_columns_is_refused(tmp_path):
    _write(tmp_path / "out.parquet", _rows(1))
    other = pa.schema([pa.field("messages", pa.string())])
    with pytest.raises(ValueError, match="columns"):
        DatasetWriter(OutputConfig(path=str(tmp_path / "out.parquet"), append=True), other)


@pytest.mark.parametrize("name", ["out", "out.jsonl"])
def test_a_crash_mid_export_leaves_the_previous_output_untouched(tmp_path, name):
    _write(tmp_path / name, _rows(3))
    before = sorted((tmp_path / name).rglob("*")) if name == "out" else (tmp_path / name).read_bytes()
    writer = DatasetWriter(OutputConfig(path=str(tmp_path / name), overwrite=True), SCHEMA)
    for row in _rows(5000):
        writer.write(row)
    writer.flush()
    writer.abort()  # what the pipeline does when anything raises
    after = sorted((tmp_path / name).rglob("*")) if name == "out" else (tmp_path / name).read_bytes()
    assert before == after
    assert _hidden(tmp_path) == []


def test_nothing_is_visible_before_close(tmp_path):
    writer = DatasetWriter(OutputConfig(path=str(tmp_path / "out.jsonl")), SCHEMA)
    for row in _rows(3000):
        writer.write(row)
    writer.flush()
    assert not (tmp_path / "out.jsonl").exists()
    writer.close()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 3000 and json.loads(lines[-1]) == {"text": "row 2999", "score": 2999.0}


def test_empty_export_publishes_a_loadable_empty_shard(tmp_path):
    [path] = _write(tmp_path / "out", [])
    assert pq.read_table(path).num_rows == 0 and pq.read_schema(path).names == ["text", "score"]


def test_overwrite_and_append_together_are_refused():
    with pytest.raises(ValueError, match="pick one"):
        OutputConfig(path="x", overwrite=True, append=True)
