"""Run an unchanged Atropos env script in `serve` mode against run-api, and watch its groups land in the store.

The env runs as a subprocess with the python of its own venv (atroposlib's pins need not match ours):

    <python> <script> serve --env.rollout_server_url <api> --env.wandb_name <name> --env.use_wandb false
                            --openai.base_url <inference> [--openai.model_name M] <extra args>

Progress is read from run-api's `/status` (`ingested`: posted groups committed to the store, by env name), so
it counts only what is durable. One call supervises one life of the process: it returns when the target group
count or the deadline is reached (stopping the process) or when the process exits cleanly (the env's own
`total_steps`), and raises `EnvProcessDied` when the process exits with an error, so the caller (a Prefect task
with retries) starts it again. Counting is against a baseline taken before the first start, so a restarted
process continues the same count.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import Field, field_validator

from factory.config import FactoryConfig

logger = logging.getLogger(__name__)


class AtroposEnvConfig(FactoryConfig):
    """How to start one Atropos env script and when to stop it."""

    script: str = Field(description="Path of the Atropos env script (a file that ends with `MyEnv.cli()`).")
    python: str | None = Field(None, description="Python of the env's venv (with atroposlib); default $ATROPOS_PYTHON, "
                                                 "else `python` on PATH.")
    api_url: str = Field("http://127.0.0.1:8000", description="run-api base URL the env posts its groups to.")
    inference_url: str | None = Field(None, description="OpenAI-compatible base URL (…/v1) passed as "
                                                        "--openai.base_url; None leaves the env's own default.")
    model_name: str | None = Field(None, description="Passed as --openai.model_name when set.")
    env_name: str = Field("atropos-env", description="Passed as --env.wandb_name: run-api stores and counts the groups "
                                                     "under this name.")
    args: list[str] = Field(default_factory=list, description="Extra CLI arguments for the env, e.g. "
                                                              "['--env.group_size', '8'].")
    target_groups: int | None = Field(None, ge=1, description="Stop once this many groups from this env are in the "
                                                              "store.")
    max_runtime_s: float | None = Field(None, gt=0, description="Stop after this many seconds (over all restarts).")
    max_restarts: int = Field(3, ge=0, description="How often a process that died is started again before the run "
                                                   "fails.")
    register_trainer: bool = Field(True, description="If no trainer has registered with run-api yet, register one "
                                                     "(batch_size, max_token_len) so the env may start; a real "
                                                     "trainer registering later takes over.")
    batch_size: int = Field(64, ge=1, description="batch_size of that registration.")
    max_token_len: int = Field(4096, ge=1, description="max_token_len of that registration.")
    poll_s: float = Field(1.0, gt=0, description="Seconds between /status polls.")
    stop_grace_s: float = Field(10.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping the env.")
    log_path: str | None = Field(None, description="File the env's stdout/stderr are appended to; default "
                                                   "./logs/atropos-env-<env_name>.log.")

    @field_validator("args", mode="before")
    @classmethod
    def _args_as_text(cls, value: object) -> object:
        # YAML and dotted overrides turn '8' into 8; the env's CLI wants text.
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else value

    def command(self) -> list[str]:
        """The env's command line."""
        python = self.python or os.environ.get("ATROPOS_PYTHON") or "python"
        cmd = [python, self.script, "serve", "--env.rollout_server_url", self.api_url,
               "--env.wandb_name", self.env_name, "--env.use_wandb", "false"]
        if self.inference_url:
            cmd += ["--openai.base_url", self.inference_url]
        if self.model_name:
            cmd += ["--openai.model_name", self.model_name]
        return cmd + list(self.args)


class EnvProcessDied(RuntimeError):
    """The env process exited with an error (the caller may start it again)."""


@dataclass
class EnvProgress:
    """Where a supervised env stands."""

    groups: int
    seconds: float
    restarts: int = 0
    returncode: int | None = None
    stopped_by: str | None = None  # "target", "deadline" or "exit"


def ingested_groups(api_url: str, env_name: str, client: httpx.Client | None = None) -> int:
    """Groups of `env_name` that run-api has committed to the store (its /status `ingested`)."""
    get = client.get if client is not None else httpx.get
    response = get(f"{api_url.rstrip('/')}/status", timeout=10)
    response.raise_for_status()
    ingested = response.json().get("ingested")
    if ingested is None:
        raise RuntimeError(f"{api_url}/status has no 'ingested' counts: point api_url at the factory's run-api "
                           "(factory/serve), not atroposlib's")
    return int(ingested.get(env_name, 0))


def ensure_trainer(config: AtroposEnvConfig) -> bool:
    """Register a stand-in trainer when run-api has none (envs wait for one); True if it registered one."""
    base = config.api_url.rstrip("/")
    info = httpx.get(f"{base}/info", timeout=10).raise_for_status().json()
    if info.get("batch_size", -1) != -1 or not config.register_trainer:
        return False
    body = {"wandb_group": "factory", "wandb_project": "atropos-env", "batch_size": config.batch_size,
            "max_token_len": config.max_token_len, "checkpoint_dir": "", "save_checkpoint_interval": -1,
            "starting_step": 0, "num_steps": -1}
    httpx.post(f"{base}/register", json=body, timeout=10).raise_for_status()
    # As in Atropos, envs may register only once the trainer has asked for a batch. Groups already queued beyond
    # batch_size would make this call take one batch (marked served in run-api; its shards stay in the store).
    batch = httpx.get(f"{base}/batch", timeout=30).raise_for_status().json().get("batch")
    logger.info("no trainer registered at %s: registered batch_size=%d so the env can start%s", base,
                config.batch_size, f" (this served one queued batch of {len(batch)} groups)" if batch else "")
    return True


def _stop(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the env's process group, SIGKILL after `grace_s`; returns its exit code."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return process.wait()


def supervise_env(config: AtroposEnvConfig, *, baseline: int, deadline: float | None, restarts: int = 0,
                  on_progress: Callable[[EnvProgress], None] | None = None) -> EnvProgress:
    """Run the env until the target, the deadline (time.time()) or its clean exit; raise EnvProcessDied on a crash.

    `baseline` is the env's ingested count before the run began; progress counts groups above it.
    """
    script = Path(config.script)
    if not script.is_file():
        raise FileNotFoundError(f"Atropos env script {config.script!r} does not exist; give env.script as a path")
    log_path = Path(config.log_path or f"logs/atropos-env-{config.env_name}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "ab") as log, httpx.Client() as client:
        process = subprocess.Popen(config.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        logger.info("started Atropos env %s (pid %d, restart %d), log %s", script, process.pid, restarts, log_path)
        progress = EnvProgress(groups=0, seconds=0.0, restarts=restarts)
        try:
            while True:
                returncode = process.poll()
                try:
                    progress.groups = ingested_groups(config.api_url, config.env_name, client) - baseline
                except httpx.HTTPError as error:  # run-api restarting: keep the env, poll again
                    logger.warning("cannot read %s/status (%s); will poll again", config.api_url, error)
                progress.seconds = round(time.monotonic() - started, 2)
                if on_progress is not None:
                    on_progress(progress)
                if config.target_groups is not None and progress.groups >= config.target_groups:
                    progress.stopped_by = "target"
                    break
                if deadline is not None and time.time() >= deadline:
                    progress.stopped_by = "deadline"
                    break
                if returncode is not None:
                    progress.returncode = returncode
                    if returncode != 0:
                        tail = _tail(log_path)
                        raise EnvProcessDied(f"Atropos env {script} exited with code {returncode} after "
                                             f"{progress.seconds:.0f}s; last log lines ({log_path}):\n{tail}")
                    progress.stopped_by = "exit"
                    break
                time.sleep(config.poll_s)
        finally:
            code = _stop(process, config.stop_grace_s)
            if progress.returncode is None and progress.stopped_by is not None:
                progress.returncode = code
    return progress


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class AtroposEnvJob(FactoryConfig):
    """The `atropos-env` flow's parameters: the env section and where its process runs."""

    env: AtroposEnvConfig = Field(description="The Atropos env to run and when to stop it.")
    task_runner_block: str | None = Field(None, description="Block slug 'type/name' whose task_runner() places the env "
                                                            "process (e.g. factory-slurm-cluster/datagen-nodes for a "
                                                            "SLURM job); None runs it beside the flow.")
