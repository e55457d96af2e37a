"""factory/atropos_env.py: the env's command line, and how one process life ends (clean exit, crash, deadline)."""

from __future__ import annotations

import sys
import time

import pytest

from factory.atropos_env import AtroposEnvConfig, AtroposEnvJob, EnvProcessDied, supervise_env
from factory.config import ConfigError, build_config


def config(tmp_path, body: str, **extra) -> AtroposEnvConfig:
    script = tmp_path / "env.py"
    script.write_text(body)
    return AtroposEnvConfig(script=str(script), python=sys.executable, api_url="http://127.0.0.1:9",  # nothing there
                            log_path=str(tmp_path / "env.log"), poll_s=0.05, stop_grace_s=2, **extra)


def test_command_is_atropos_serve_with_the_api_the_name_and_text_args(tmp_path):
    cfg = config(tmp_path, "", inference_url="http://h:30000/v1", model_name="m", env_name="gsm",
                 args=["--env.group_size", 8])
    assert cfg.command() == [sys.executable, cfg.script, "serve", "--env.rollout_server_url", "http://127.0.0.1:9",
                             "--env.wandb_name", "gsm", "--env.use_wandb", "false", "--openai.base_url",
                             "http://h:30000/v1", "--openai.model_name", "m", "--env.group_size", "8"]


def test_a_crash_raises_with_the_log_tail_and_a_clean_exit_returns(tmp_path):
    crashing = config(tmp_path, "print('env broke: no tokenizer'); raise SystemExit(3)")
    with pytest.raises(EnvProcessDied, match="(?s)exited with code 3.*env broke: no tokenizer"):
        supervise_env(crashing, baseline=0, deadline=None)
    done = supervise_env(config(tmp_path, "pass"), baseline=0, deadline=None)
    assert (done.stopped_by, done.returncode, done.groups) == ("exit", 0, 0)


def test_the_deadline_stops_a_running_env(tmp_path):
    started = time.monotonic()
    progress = supervise_env(config(tmp_path, "import time; time.sleep(60)"), baseline=0, deadline=time.time() + 1)
    assert progress.stopped_by == "deadline"
    assert time.monotonic() - started < 10
    assert progress.returncode != 0  # stopped by SIGTERM


def test_missing_script_and_unknown_keys_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="env.script"):
        supervise_env(AtroposEnvConfig(script=str(tmp_path / "nope.py")), baseline=0, deadline=None)
    with pytest.raises(ConfigError, match="target_group"):
        build_config(AtroposEnvJob, values={"env": {"script": "x.py", "target_group": 3}})
