"""The `rl-loop` flow end to end on a tiny budget: real Prefect server, policy server, batching API, datagen flow
and trainer flow; asserts that reward rows and eval rows were written and that training never saw an eval problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TINY = {"families": ["modulo", "sorting"], "difficulties": [1], "total_steps": 2, "batch_size": 16, "group_size": 4,
        "checkpoint_every": 1, "warmup_steps": 0, "eval_per_family": 6, "min_eval_problems": 1, "datagen_items": 400,
        "chunk_items": 4, "max_tokens": 16}


def test_rl_loop_flow_writes_reward_and_eval_rows(prefect_server: dict[str, str], tmp_path: Path) -> None:
    from prefect.artifacts import Artifact

    from flows.rl_loop import rl_loop

    out = tmp_path / "run"
    report = rl_loop(loop={**TINY, "out_dir": str(out), "seed": 3})
    metrics = [json.loads(line) for line in Path(report["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2] and all("reward_mean" in r for r in metrics)
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    heads = {(r["phase"], r["level"], r["temperature"]) for r in rows if r["family"] == "headline"}
    assert heads == {(p, lv, t) for p in ("before", "after") for lv in (1, 2) for t in (0.0, 1.0)}
    assert all(r["n"] > 0 and r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] for r in rows)
    assert report["overlap_planned"] == 0 and report["overlap_trained"] == 0 and report["problems_made"] > 0
    assert report["steps"] == 2 and 0 < report["busy_share"] <= 1.0 and report["policy_lag_max"] is not None
    assert (out / "report.png").stat().st_size > 1000 and "95% CI" in (out / "report.md").read_text()
    assert Artifact.get("rl-loop-report") is not None
