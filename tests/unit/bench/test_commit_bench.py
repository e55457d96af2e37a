"""bench.serve.commit_bench measures a commit per group count (a tiny size, in process)."""

from __future__ import annotations

import json

from bench.serve import commit_bench


def test_measure_reports_every_group_count():
    result = commit_bench.measure(reps=1, length=8, size=2)
    assert set(result) == {str(count) for count in commit_bench.COUNTS}
    for numbers in result.values():
        assert numbers["cpu_ms"] > 0 and numbers["wall_ms"] > 0 and numbers["build_cpu_ms"] >= 0


def test_versus_that_is_not_a_checkout_fails_in_one_line(tmp_path, capsys):
    assert commit_bench.main(["--versus", str(tmp_path), "--smoke"]) == 2
    assert "not a checkout" in capsys.readouterr().err


def test_commit_parts_reports_every_count_and_step():
    from bench.serve import commit_parts

    result = commit_parts.measure(reps=1, seq_len=8)
    assert set(result["commit"]) == set(result["parts"]) == set(commit_parts.COUNTS)
    for count in commit_parts.COUNTS:
        assert result["commit"][count]["cpu_ms"] > 0
        assert result["parts"][count]["Parquet encode"]["cpu_ms"] > 0


def test_fsync_pair_reports_both_modes(capsys):
    from bench.serve import fsync_pair

    assert fsync_pair.main(["--smoke"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line) == {"load1", *fsync_pair.MODES}
    assert all(line[mode]["shard_fsyncs_ms"] > 0 for mode in fsync_pair.MODES)
