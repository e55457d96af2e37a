"""Start a torchrun trainer job and follow it: as local processes, or as one SLURM job (one srun task per node).

    spec = SlurmLaunchSpec(partition="gpu", nodes=4, gpus_per_node=8)      # or LocalLaunchSpec(nproc_per_node=2)
    job = launch(spec, job_config_yaml, log_dir)                            # torchrun ... -m flows.train --config ...
    code = follow(job, on_line=print, on_row=print)                         # log lines, metrics rows, exit code

The trainer reads one resolved YAML (`<output_dir>/job_config.yaml`), so the
job runs exactly the config the flow validated. The whole job writes one log
file; `follow` hands its lines and every new `metrics.jsonl` row to callbacks
(the `grpo-train` flow sends them to its run log and progress artifact) until
the job ends. A SLURM job writes its exit code to `<log>.exit` as its last act.
Plain code, no Prefect: `blocks/train_launch.py` stores these specs as blocks.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from factory.config import FactoryConfig

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """The job could not be started (bad partition, sbatch refused); the message names the cause."""


class LocalLaunchSpec(FactoryConfig):
    """torchrun on this machine: one process per rank."""

    kind: Literal["local"] = Field("local", description="Local torchrun processes.")
    nproc_per_node: int = Field(2, ge=1, description="Ranks (processes) to start; one per GPU on a GPU machine.")
    python: str | None = Field(None, description="Interpreter; default: the flow's.")
    environment: dict[str, str] = Field(default_factory=dict, description="Variables set for the ranks.")


class SlurmLaunchSpec(FactoryConfig):
    """One SLURM job of `nodes` nodes; on each, torchrun starts `gpus_per_node` (or `processes_per_node`) ranks."""

    kind: Literal["slurm"] = Field("slurm", description="An sbatch job.")
    nodes: int = Field(1, ge=1, description="Nodes (sbatch --nodes); torchrun's c10d rendezvous joins them.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (--gpus-per-node) and ranks per node; 0: CPU job.")
    processes_per_node: int = Field(1, ge=1, description="Ranks per node when gpus_per_node is 0 (CPU, gloo).")
    cpus_per_task: int | None = Field(None, ge=1, description="CPU cores per node's task (--cpus-per-task).")
    memory: str | None = Field(None, description="Memory per node (--mem), e.g. '200G'.")
    walltime: str = Field("04:00:00", description="--time of the job.")
    partition: str | None = Field(None, description="SLURM partition (-p); checked with sinfo before submitting.")
    account: str | None = Field(None, description="SLURM account (-A).")
    qos: str | None = Field(None, description="SLURM QOS (--qos).")
    job_name: str = Field("grpo-train", description="SLURM job name.")
    extra_directives: list[str] = Field(default_factory=list, description="More '#SBATCH' options, e.g. '--exclusive'.")
    prologue: list[str] = Field(default_factory=list, description="Shell lines before torchrun (modules, venv).")
    environment: dict[str, str] = Field(default_factory=dict, description="Variables exported in the job.")
    project_dir: str | None = Field(None, description="Checkout the nodes import (a shared path); default: the flow's.")
    python: str | None = Field(None, description="Python on the nodes; default: the flow's interpreter.")
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="Base port of the rendezvous on the first node "
                                                                 "(the job id modulo 1000 is added, so jobs do not collide).")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.processes_per_node


@dataclass
class Job:
    """A started trainer job: its log, how to tell whether it still runs, how to stop it."""

    kind: str
    log: Path
    process: subprocess.Popen | None = None
    job_id: str | None = None
    output_dir: Path = field(default_factory=Path)

    def exit_code(self) -> int | None:
        """None while the job runs; its exit code after."""
        if self.process is not None:
            return self.process.poll()
        state = subprocess.run(["squeue", "-h", "-j", str(self.job_id), "-o", "%T"], capture_output=True, text=True)
        if state.returncode == 0 and state.stdout.strip():
            return None
        marker = self.log.with_suffix(".exit")
        for _ in range(20):  # the job is gone from the queue; its exit-code file may trail by a moment
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().strip())
            time.sleep(0.25)
        return 1  # ended without writing its exit code: cancelled, out of time or memory (see the log)

    def cancel(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        elif self.job_id is not None:
            subprocess.run(["scancel", str(self.job_id)], capture_output=True)


def torchrun_args(nproc: int, *, nnodes: int | str = 1, rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None) -> list[str]:
    """`-m torch.distributed.run` options: standalone on one node, c10d rendezvous across nodes."""
    if rdzv_endpoint is None:
        return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]


def check_partition(partition: str | None) -> None:
    """Fail with one line when the partition does not exist (before sbatch)."""
    if partition is None:
        return
    found = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%P"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        known = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True).stdout.split()
        raise LaunchError(f"SLURM partition {partition!r} does not exist; known partitions: "
                          f"{', '.join(p.rstrip('*') for p in known) or 'none'} (set the launcher block's partition)")


def sbatch_script(spec: SlurmLaunchSpec, job_config: Path, log: Path) -> str:
    """The batch script: resources, environment, one srun task per node running torchrun, exit code written last."""
    python = spec.python or sys.executable
    project = Path(spec.project_dir or PROJECT_ROOT)
    directives = [f"--job-name={spec.job_name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
                  f"--time={spec.walltime}", f"--output={log}"]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    directives += [f"--cpus-per-task={spec.cpus_per_task or spec.ranks_per_node}"]
    for flag, value in (("--mem", spec.memory), ("--partition", spec.partition), ("--account", spec.account),
                        ("--qos", spec.qos)):
        if value:
            directives.append(f"{flag}={value}")
    directives += spec.extra_directives
    run = [python, *torchrun_args(spec.ranks_per_node, nnodes="$SLURM_NNODES", rdzv_endpoint="$HEAD:$PORT",
                                  rdzv_id="$SLURM_JOB_ID"), "-m", "flows.train", "--config", str(job_config)]
    run_line = " ".join(a if a.startswith("$") or a.startswith('"$') else shlex.quote(a) for a in run)
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             f"cd {shlex.quote(str(project))}",
             f'export PYTHONPATH={shlex.quote(str(project))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
             *(f"export {k}={shlex.quote(v)}" for k, v in spec.environment.items()),
             *spec.prologue,
             'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"PORT=$(( {spec.rdzv_port} + SLURM_JOB_ID % 1000 ))",
             'echo "grpo-train job $SLURM_JOB_ID: $SLURM_NNODES node(s), rendezvous $HEAD:$PORT"',
             # --kill-on-bad-exit: a node whose torchrun fails ends the whole step (the other nodes' ranks too)
             f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {run_line}",
             "code=$?",
             f"echo $code > {shlex.quote(str(log.with_suffix('.exit')))}",
             "exit $code", ""]
    return "\n".join(lines)


def launch(spec: LocalLaunchSpec | SlurmLaunchSpec, job_config: Path, log_dir: Path) -> Job:
    """Start the job that trains with `job_config` (a resolved YAML); its output goes to a log under `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if isinstance(spec, LocalLaunchSpec):
        log = log_dir / f"train-{stamp}.log"
        env = {**os.environ, **spec.environment,
               "PYTHONPATH": f"{PROJECT_ROOT}{os.pathsep}{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH")
               else str(PROJECT_ROOT)}
        command = [spec.python or sys.executable, *torchrun_args(spec.nproc_per_node), "-m", "flows.train",
                   "--config", str(job_config)]
        with open(log, "ab") as out:
            process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        logger.info("started %s (pid %d), log %s", " ".join(command), process.pid, log)
        return Job("local", log, process=process)
    check_partition(spec.partition)
    log = log_dir / f"train-slurm-{stamp}.log"
    script = log.with_suffix(".sbatch")
    script.write_text(sbatch_script(spec, job_config, log))
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if submitted.returncode != 0:
        raise LaunchError(f"sbatch refused {script}: {submitted.stderr.strip().splitlines()[-1:] or ['no message']}")
    job_id = submitted.stdout.strip().split(";")[0]
    logger.info("submitted SLURM job %s (%d node(s) x %d rank(s)), log %s", job_id, spec.nodes, spec.ranks_per_node, log)
    return Job("slurm", log, job_id=job_id)


def follow(job: Job, metrics: Path, *, on_line: Callable[[str], None] | None = None,
           on_row: Callable[[dict], None] | None = None, poll_s: float = 1.0, timeout_s: float | None = None) -> int:
    """Hand every new log line and metrics row to the callbacks until the job ends; returns its exit code."""
    log_pos, rows_seen = 0, 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def drain() -> None:
        nonlocal log_pos, rows_seen
        if job.log.is_file():
            with open(job.log, "rb") as f:
                f.seek(log_pos)
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1
            log_pos += cut
            for line in chunk[:cut].decode(errors="replace").splitlines():
                if line.strip() and on_line is not None:
                    on_line(line)
        if metrics.is_file():
            lines = metrics.read_text().splitlines()
            for line in lines[rows_seen:]:
                if line.strip() and on_row is not None:
                    on_row(json.loads(line))
            rows_seen = len(lines)

    try:
        while True:
            code = job.exit_code()
            drain()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"trainer job did not end within {timeout_s} s; log {job.log}")
            time.sleep(poll_s)
    except BaseException:
        job.cancel()  # the flow was cancelled or failed: do not leave ranks or a SLURM job behind
        raise


def failure_line(log: Path) -> str:
    """The most telling line of a failed job's log: the trainer's own one-line error, else the last error line."""
    if not log.is_file():
        return f"no log at {log}"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "train-grpo: error:" in line:
            return line.strip()
    for marker in ("Error", "error", "exitcode", "Signal", "CANCELLED", "DUE TO"):
        for line in reversed(lines):
            if marker in line:
                return line.strip()
    return lines[-1].strip() if lines else f"empty log {log}"
