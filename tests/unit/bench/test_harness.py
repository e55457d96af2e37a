"""The bench harness: interleaving, ratios within a round, JSON lines, the command, smoke flags, tables."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from bench import harness
from bench.harness import Side, compare


def test_sides_run_interleaved_and_ratios_are_taken_within_each_round(tmp_path):
    order = []
    a_values = iter([100.0, 50.0, 200.0])   # the machine got slower, then faster: ratios stay 2.0, 2.5, 2.0
    b_values = iter([50.0, 20.0, 100.0])

    def side(name, values):
        def run():
            order.append(name)
            return next(values)
        return Side(name, run)

    out = tmp_path / "bench.jsonl"
    result = compare("demo", [side("b", b_values), side("a", a_values)], pairs=3, metric="groups/s", json_out=out)

    assert order == ["b", "a", "b", "a", "b", "a"]
    assert result.ratios("a", "groups/s") == [2.0, 2.5, 2.0]
    assert result.median_ratio("a", "groups/s") == 2.0
    assert result.spread("a", "groups/s") == (2.0, 2.5)
    assert result.median_ratio("b", "groups/s") == 1.0
    assert result.median("a", "groups/s") == 100.0

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6
    assert [(r["side"], r["round"], r["value"]) for r in records[:2]] == [("b", 0, 50.0), ("a", 0, 100.0)]
    for record in records:
        assert record["bench"] == "demo" and record["metric"] == "groups/s" and record["baseline"] == "b"
        assert record["cpus"] >= 1 and "load1" in record and record["command"]


def test_sides_may_return_several_metrics_and_name_a_baseline():
    result = compare("demo", [Side("ours", lambda: {"ingest/s": 10.0, "p50 ms": 4.0}),
                              Side("theirs", lambda: {"ingest/s": 5.0, "p50 ms": 8.0})], pairs=3, baseline="theirs")
    assert result.metrics == ["ingest/s", "p50 ms"]
    assert result.median_ratio("ours", "ingest/s") == 2.0
    assert result.median_ratio("ours", "p50 ms") == 0.5
    rows = harness.comparison_rows(result)
    assert [row[:2] for row in rows] == [["ours", "ingest/s"], ["theirs", "ingest/s"],
                                         ["ours", "p50 ms"], ["theirs", "p50 ms"]]
    assert rows[0][3] == "2.00x" and rows[0][4] == "2.00-2.00x" and rows[0][5] == 3


def test_warmup_runs_each_side_once_untimed():
    calls = []
    result = compare("demo", [Side("a", lambda: calls.append("a") or 1.0), Side("b", lambda: calls.append("b") or 1.0)],
                     pairs=2, warmup=True)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert len(result.values["a"]["value"]) == 2


def test_bad_sides_are_refused():
    with pytest.raises(ValueError):
        compare("demo", [Side("a", lambda: 1.0), Side("a", lambda: 1.0)])
    with pytest.raises(ValueError):
        compare("demo", [Side("a", lambda: 1.0)], baseline="zzz")


def test_smoke_flags_pick_one_round_and_keep_json_out_of_results(tmp_path):
    parser = harness.add_bench_args(argparse.ArgumentParser(), pairs=5)
    smoke = parser.parse_args(["--smoke"])
    assert harness.pairs_from(smoke) == 1
    assert harness.json_path("x", smoke) == harness.SMOKE_DIR / "x.jsonl"
    full = parser.parse_args([])
    assert harness.pairs_from(full) == 5
    assert harness.json_path("x", full) == harness.RESULTS_DIR / "x.jsonl"
    chosen = parser.parse_args(["--smoke", "--pairs", "4", "--json-out", str(tmp_path / "o.jsonl")])
    assert harness.pairs_from(chosen) == 4 and harness.json_path("x", chosen) == tmp_path / "o.jsonl"


def test_command_line_reproduces_a_module_invocation(monkeypatch):
    class Spec:
        name = "bench.demo.run"

    monkeypatch.setattr(sys.modules["__main__"], "__spec__", Spec(), raising=False)
    monkeypatch.setattr(sys, "argv", ["/x/bench/demo/run.py", "--groups", "10", "--label", "a b"])
    monkeypatch.setenv("ATROPOS_VENV", "/opt/v")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert harness.command_line() == "ATROPOS_VENV=/opt/v python -m bench.demo.run --groups 10 --label 'a b'"


def test_tables_are_markdown_with_numbers_right_aligned(capsys):
    harness.print_table(["path", "groups/s"], [("raw", 300.0), ("flow", 2.5)], title="demo")
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "## demo"
    assert out[2:] == ["| path | groups/s |", "|---|---:|", "| raw | 300.0 |", "| flow | 2.50 |"]


def test_print_comparison_shows_command_and_load(capsys):
    result = harness.measure("demo", "only", lambda: 3.0, repeats=2)
    harness.print_comparison(result)
    out = capsys.readouterr().out
    assert "| only | value | 3.00 | 1.00x | 1.00-1.00x | 2 |" in out
    assert "Command: `" in out and "load1 " in out


def test_a_metric_the_baseline_lacks_is_compared_with_the_baselines_first_metric():
    result = compare("demo", [Side("raw", lambda: 100.0),
                              Side("flow", lambda: {"groups/s": 50.0, "groups/s, pipeline only": 80.0})],
                     metric="groups/s")
    assert result.metrics == ["groups/s", "groups/s, pipeline only"]
    assert result.median_ratio("flow", "groups/s, pipeline only") == 0.8
    assert [row[:2] for row in harness.comparison_rows(result)] == [
        ["raw", "groups/s"], ["flow", "groups/s"], ["flow", "groups/s, pipeline only"]]


def test_ratios_to_another_side_and_small_ratios_keep_three_decimals():
    result = compare("demo", [Side("raw", lambda: 1000.0), Side("ours", lambda: 60.0), Side("theirs", lambda: 40.0)])
    assert result.median_ratio("ours", "value", versus="theirs") == 1.5
    assert harness.comparison_rows(result)[1][3:5] == ["0.060x", "0.060-0.060x"]


def test_a_metric_in_another_unit_than_the_baseline_gets_no_ratio():
    """A flow's CPU per group divided by the raw loop's groups/s is no ratio at all: the table shows '-'."""
    result = compare("demo", [Side("raw", lambda: {"groups/s": 1000.0}),
                              Side("flow", lambda: {"groups/s": 250.0, "groups/s, pipeline only": 300.0,
                                                    "process CPU us/group": 900.0})])
    assert set(result.ratios("flow", "groups/s, pipeline only")) == {0.3}
    assert result.ratios("flow", "process CPU us/group") == []
    rows = {(row[0], row[1]): row[3:5] for row in harness.comparison_rows(result)}
    assert rows[("flow", "process CPU us/group")] == ["-", "-"]
    assert rows[("flow", "groups/s")] == ["0.25x", "0.25-0.25x"]
