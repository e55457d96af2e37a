"""The RL loop's checks before it starts, its eval sets and the report's numbers (no servers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.bootcamp_tasks.split import ContentSplit, problem_id
from factory.train.evaluate import EvalResult, wilson_interval
from factory.train.rl_plan import LoopInputError, RLLoopConfig, build_plan, check_inputs, check_plan, eval_levels, train_env
from factory.train.rl_report import eval_rows, headline_table, markdown, plot
from flows.rl_loop import main

ROOT = Path(__file__).resolve().parents[3]
SMALL = dict(families=["modulo", "sorting", "gcd"], datagen_items=2000, eval_per_family=30, min_eval_problems=25)


def test_plan_has_zero_overlap_and_levels_trained_and_above() -> None:
    cfg = RLLoopConfig(**SMALL)
    plan = build_plan(cfg)
    check_plan(plan)
    assert plan.overlap == 0 and plan.planned_train_items == 2000
    assert [(lv.level, lv.role) for lv in plan.levels] == [(1, "trained"), (2, "above")]
    level1 = plan.levels[0]
    assert "gcd" in level1.evalset.too_small and "gcd" not in level1.headline_families  # 64 gcd problems at level 1
    assert "gcd" in plan.levels[1].headline_families
    assert eval_levels(RLLoopConfig(difficulties=[5])) == [(5, "trained")]


def test_an_eval_set_that_overlaps_training_is_refused(tmp_path: Path) -> None:
    cfg = RLLoopConfig(**SMALL)
    trained = [train_env(cfg).get_item(i).answer for i in range(20)]
    keys = tmp_path / "eval.jsonl"
    keys.write_text("".join(json.dumps({"key": c.key}) + "\n" for c in trained))
    plan = build_plan(cfg.model_copy(update={"eval_set": str(keys)}))
    assert plan.overlap >= 1
    with pytest.raises(LoopInputError, match="eval set overlaps training") as error:
        check_plan(plan)
    assert "\n" not in str(error.value)


def test_bad_inputs_fail_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LoopInputError, match="starter policy missing"):
        check_inputs(RLLoopConfig(policy=str(tmp_path / "nope")), ROOT)
    with pytest.raises(LoopInputError, match="too small for one trainer step"):
        check_inputs(RLLoopConfig(budget_s=3), ROOT)
    check_inputs(RLLoopConfig(budget_s=3, total_steps=2), ROOT)  # a step count is its own stop rule
    with pytest.raises(LoopInputError, match="unknown families"):
        check_inputs(RLLoopConfig(families=["nope"]), ROOT)
    for argv, cause in ((["--budget_s", "5"], "budget_s 5"), (["--policy", str(tmp_path / "x")], "starter policy missing"),
                        (["--budget_s", "-1"], "budget_s")):
        assert main([*argv, "--out_dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and cause in err
    assert not (tmp_path / "out").exists()  # nothing was started or written


def test_help_states_the_stop_rule_and_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "Stopping rule" in text and "--seed" in text and "--total_steps" in text and "--budget_s" in text


def test_wilson_interval() -> None:
    low, high = wilson_interval(0, 50)
    assert low == 0 and 0.05 < high < 0.09
    low, high = wilson_interval(30, 60)
    assert low < 0.5 < high and abs((0.5 - low) - (high - 0.5)) < 1e-9
    assert EvalResult(10, 5, {"a": (3, 4), "b": (2, 6)}).subset({"a"}).accuracy == 0.75


def test_report_rows_table_markdown_and_png(tmp_path: Path) -> None:
    results = {(1, "trained", 0.0): EvalResult(20, 10, {"modulo": (8, 10), "gcd": (2, 10)}),
               (2, "above", 1.0): EvalResult(10, 0, {"modulo": (0, 10)})}
    better = {(1, "trained", 0.0): EvalResult(20, 14, {"modulo": (9, 10), "gcd": (5, 10)}),
              (2, "above", 1.0): EvalResult(10, 2, {"modulo": (2, 10)})}
    headline = {1: ["modulo"], 2: ["modulo"]}
    rows = eval_rows("before", results, headline) + eval_rows("after", better, headline)
    table = headline_table(rows)
    assert [(r["level"], r["n"], r["before"], r["after"]) for r in table] == [(1, 10, 0.8, 0.9), (2, 10, 0.0, 0.2)]
    assert table[1]["after_ci95"][0] > 0
    text = markdown("t", table, ["overlap 0"], {"total_s": 1.0}, {"busy_share": 0.5, "policy_lag_mean": 1.0,
                                                                  "policy_lag_max": 2})
    assert "greedy" in text and "temperature 1" in text and "busy 50%" in text and "max 2" in text
    png = plot(tmp_path / "r.png", [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}], table)
    assert png.stat().st_size > 1000


def test_eval_sets_are_the_same_for_every_seed() -> None:
    a, b = build_plan(RLLoopConfig(**SMALL, seed=0)), build_plan(RLLoopConfig(**SMALL, seed=3))
    assert [problem_id(c) for c in a.levels[0].evalset.cases] == [problem_id(c) for c in b.levels[0].evalset.cases]
    assert ContentSplit().side(a.levels[0].evalset.cases[0]) == "eval"


def test_the_rl_loop_deployment_builds_the_flow_config() -> None:
    import yaml

    from factory.config import build_config
    from flows.rl_loop import rl_loop

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    entry = deployments["rl-loop"]
    assert entry["entrypoint"] == "flows.rl_loop:rl_loop" and rl_loop.name == "rl-loop"
    params = entry["parameters"]
    cfg = build_config(RLLoopConfig, yaml_path=ROOT / params["config_path"], values=params["loop"])
    assert cfg.total_steps is None and cfg.budget_s == 900 and cfg.max_policy_lag == 2


def test_the_batching_engine_counts_busy_and_weight_load_seconds(tmp_path: Path) -> None:
    import asyncio

    from factory.inference.engine import BatchingEngine, GenRequest, PolicyEngine
    from factory.inference.tiny_model import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "policy")
    batching = BatchingEngine(PolicyEngine(policy))
    try:
        assert batching.busy_s == 0.0 and batching.update_s == 0.0
        asyncio.run(batching.generate([GenRequest([5, 6, 7], max_new_tokens=8, seed=i) for i in range(4)]))
        assert batching.busy_s > 0.0
        asyncio.run(batching.update_weights(str(policy), 1))
        assert batching.update_s > 0.0
    finally:
        batching.close()
