"""`python -m bench.shards.scale --smoke` still runs every measurement, before and after compaction."""

from __future__ import annotations

import json
from pathlib import Path

from bench.shards import scale


def test_scale_bench_smoke(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    scale.main(["--smoke", "--dir", str(tmp_path / "scratch"), "--json-out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["before", "after"]
    for row in rows:
        assert row["export_groups"] >= 3000 and row["viewer_rows"] == 50 and row["follow_latency_s"] < 5
    assert "| 300 | after |" in capsys.readouterr().out


def test_startup_ab_smoke(tmp_path, capsys, monkeypatch):
    from bench.shards.startup_ab import main

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    main(["--smoke", "--dir", str(tmp_path)])
    assert "median start-up A" in capsys.readouterr().out


def test_compact_ab_smoke(tmp_path, capsys, monkeypatch):
    from bench.shards.compact_ab import main

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    main(["--smoke", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| A1 |" in out and "| B1 |" in out and "# B: median compaction" in out
    assert not any(tmp_path.iterdir())  # each trial's store removed


def test_compaction_compare_smoke(tmp_path, capsys):
    scale.main(["--compare", "--smoke", "--dir", str(tmp_path / "scratch")])
    out = capsys.readouterr().out
    assert "| small | 100 |" in out and "| large | 2 |" in out and "footer parse + rewrite" in out


def test_isolated_measurement_is_killed_past_its_limit():
    import multiprocessing
    import time

    import pytest

    begin = time.perf_counter()
    with pytest.raises(multiprocessing.TimeoutError):
        scale._isolated(time.sleep, 60, timeout=0.5)
    assert time.perf_counter() - begin < 30
    assert scale._cell(None, ".2f", 120) == "> 120 (killed)" and scale._cell(1.234, ".2f") == "1.23"


def test_datagen_commit_bench_smoke(capsys):
    import os

    import pytest

    pytest.importorskip("moto", minversion="5.2.5")
    from bench.shards.datagen_commit import main

    before = dict(os.environ)
    main(["--smoke"])
    out = capsys.readouterr().out
    assert "| s3, retried |" in out and "S3 requests per first commit" in out
    assert dict(os.environ) == before  # the AWS variables it set are gone
