"""Shipped deployments that the deployments test does not run: their preflight part, called without Prefect,
merges a run's keys into the deployment's and refuses a wrong input in seconds with one line."""

from __future__ import annotations

import time

import pytest

from factory.cli_errors import classify


def test_rl_loop_merges_a_runs_loop_keys_into_the_deployments(monkeypatch, tmp_path):
    import factory.config
    import flows.rl_loop as rl_loop

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    deployment = {"config_path": "deployments/rl_loop.yaml",
                  "loop": {"out_dir": str(tmp_path / "out"), "seed": 3, "policy": str(policy)}}
    monkeypatch.setattr(factory.config, "deployment_defaults", lambda: deployment)
    cfg = rl_loop.loop_config({"budget_s": 120}, "deployments/rl_loop.yaml")
    assert (cfg.budget_s, cfg.seed, cfg.out_dir, cfg.policy) == (120, 3, str(tmp_path / "out"), str(policy))


def test_rl_loop_refuses_a_missing_policy_and_a_tiny_budget_in_one_line(monkeypatch, tmp_path):
    import factory.config
    import flows.rl_loop as rl_loop

    monkeypatch.setattr(factory.config, "deployment_defaults", lambda: {})
    started = time.monotonic()
    with pytest.raises(Exception) as error:
        rl_loop.loop_config({"policy": str(tmp_path / "nowhere")}, "deployments/rl_loop.yaml")
    code, line = classify(error.value)
    assert code == 2 and "starter policy missing" in line and "\n" not in line
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    with pytest.raises(Exception) as error:
        rl_loop.loop_config({"policy": str(policy), "budget_s": 1}, "deployments/rl_loop.yaml")
    assert "too small for one trainer step" in classify(error.value)[1]
    assert time.monotonic() - started < 10
