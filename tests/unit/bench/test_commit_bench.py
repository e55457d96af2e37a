"""bench.serve.commit_bench measures a commit per group count (a tiny size, in process)."""

from __future__ import annotations

from bench.serve import commit_bench


def test_measure_reports_every_group_count():
    result = commit_bench.measure(reps=1, length=8, size=2)
    assert set(result) == {str(count) for count in commit_bench.COUNTS}
    for numbers in result.values():
        assert numbers["cpu_ms"] > 0 and numbers["wall_ms"] > 0 and numbers["build_cpu_ms"] >= 0


def test_versus_that_is_not_a_checkout_fails_in_one_line(tmp_path, capsys):
    assert commit_bench.main(["--versus", str(tmp_path), "--smoke"]) == 2
    assert "not a checkout" in capsys.readouterr().err
