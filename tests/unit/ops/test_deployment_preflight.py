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


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _AnyAnswer:
    """A local HTTP server answering every GET with `body` (a stand-in for run-api /info or a policy server)."""

    def __init__(self, body: bytes = b"{}") -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.url

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _train_cfg(**values):
    from flows.train import build_train_config

    return build_train_config(config_path="deployments/train_grpo.yaml", values=values)


def test_train_grpo_without_run_api_or_policy_server_fails_in_seconds_with_one_line():
    from factory.preflight import PreflightError, preflight_trainer

    dead = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(PreflightError) as error:
        preflight_trainer(_train_cfg(source={"api_url": dead}))
    assert "source.api_url" in str(error.value) and "start `run-api`" in str(error.value)
    with _AnyAnswer() as api, pytest.raises(PreflightError) as error:
        preflight_trainer(_train_cfg(source={"api_url": api}, push={"endpoints": [dead]}))
    assert "push.endpoints" in str(error.value) and "policy server" in str(error.value)
    with pytest.raises(PreflightError, match="train.model_path"):
        preflight_trainer(_train_cfg(train={"model_path": "models/no-such-policy"}))
    assert time.monotonic() - started < 10 and classify(error.value)[0] == 1
    with _AnyAnswer() as api, _AnyAnswer() as policy:  # the shipped deployment with both servers up passes
        preflight_trainer(_train_cfg(source={"api_url": api}, push={"endpoints": [policy]}))


def test_grpo_train_checks_the_same_before_launching_a_job():
    import inspect

    import flows.grpo_train

    source = inspect.getsource(flows.grpo_train.grpo_train.fn)
    assert source.index("preflight_trainer(cfg)") < source.index("run_train_job_task(")


def test_atropos_env_without_its_script_venv_or_run_api_fails_in_seconds(tmp_path):
    import sys

    from factory.atropos_env import AtroposEnvConfig
    from factory.preflight import PreflightError, preflight_atropos_env

    dead = f"http://127.0.0.1:{_closed_port()}"
    script = tmp_path / "env.py"
    script.write_text("print('an env')\n")
    started = time.monotonic()
    with pytest.raises(PreflightError, match="env.script"):
        preflight_atropos_env(AtroposEnvConfig(script=str(tmp_path / "missing.py"), api_url=dead))
    with pytest.raises(PreflightError, match="has no atroposlib") as error:  # this interpreter has no atroposlib
        preflight_atropos_env(AtroposEnvConfig(script=str(script), python=sys.executable, api_url=dead))
    assert "\n" not in str(error.value) and "ATROPOS_PYTHON" in str(error.value)
    with pytest.raises(PreflightError, match="cannot run it"):
        preflight_atropos_env(AtroposEnvConfig(script=str(script), python=str(tmp_path / "no-python"), api_url=dead))
    with pytest.raises(PreflightError, match="env.api_url"):  # placed on a cluster: the venv is the nodes' business
        preflight_atropos_env(AtroposEnvConfig(script=str(script), api_url=dead), local=False)
    with _AnyAnswer() as api, pytest.raises(PreflightError, match="env.inference_url"):
        preflight_atropos_env(AtroposEnvConfig(script=str(script), api_url=api, inference_url=dead + "/v1"),
                              local=False)
    assert time.monotonic() - started < 10


def test_atropos_env_flow_runs_the_preflight_before_the_env_process():
    import inspect

    import flows.atropos_env

    source = inspect.getsource(flows.atropos_env.atropos_env_flow.fn)
    assert source.index("preflight_atropos_env(") < source.index("ensure_trainer(")


def test_a_slurm_launcher_without_the_slurm_client_is_one_line(monkeypatch):
    import shutil

    from factory.preflight import PreflightError, check_slurm_client

    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(PreflightError, match="sbatch and sinfo not on PATH") as error:
        check_slurm_client("launcher_block", "factory-slurm-torchrun/gpu-nodes")
    assert classify(error.value)[0] == 1 and "\n" not in str(error.value)


def test_a_refused_slurm_launch_is_a_user_error():
    from factory.train.launch import LaunchError

    assert classify(LaunchError("SLURM partition 'gpu' does not exist; known partitions: debug")) == (
        1, "SLURM partition 'gpu' does not exist; known partitions: debug")
