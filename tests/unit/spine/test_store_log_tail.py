"""The commit log is parsed incrementally: appends by other writers are seen, torn tails are retried, rewrites reset."""

from __future__ import annotations

import dataclasses

from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def test_committed_sees_other_writers_appends_and_torn_tails(tmp_path):
    reader, writer = ShardStore(tmp_path), ShardStore(tmp_path)
    groups = list(synthetic_groups(2, seq_len=8))
    writer.commit("run", "a", 0, groups)
    assert len(reader.committed("run")) == 1
    writer.commit("run", "a", 1, groups)
    assert len(reader.committed("run")) == 2
    log = reader.commit_log("run")
    record = reader.committed("run")["a-00000001.parquet"]
    line = dataclasses.replace(record, chunk=2, shard="a-00000002.parquet").to_line()
    with open(log, "ab") as handle:
        handle.write(line[:40])  # torn
    assert len(reader.committed("run")) == 2
    with open(log, "ab") as handle:
        handle.write(line[40:])
    assert len(reader.committed("run")) == 3
    text = log.read_text().splitlines()
    log.write_text(text[0] + "\n")  # a shorter log (rewritten): parsed again from the start
    assert len(reader.committed("run")) == 1
