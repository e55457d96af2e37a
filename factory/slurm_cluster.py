"""Dask workers as SLURM jobs (dask-jobqueue): what each job asks for, what it runs first, how jobs are found again.

Plain code, no Prefect: `blocks/slurm.py` stores a `SlurmClusterSpec` as a
block and turns it into a `DaskTaskRunner`; tests call these functions
directly. Each worker job is named `<job_name>-<run id>`, so the jobs of one
run can be listed (`squeue --name`) and cancelled (`scancel --name`) even by a
process that did not submit them, e.g. after the flow that did was killed.
Every job logs to `<log_dir>/<job id>/worker.log` (the prologue's output, the
Dask worker, the node-local inference server if any) and SLURM's own messages
(time limit, cancellation, out of memory) to `<log_dir>/slurm-<job id>.out`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from factory.config import FactoryConfig

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the flow runs from; worker jobs import the project from here unless `project_dir` says otherwise."""


class SlurmClusterSpec(FactoryConfig):
    """One kind of Dask worker job on SLURM and how many of them the cluster may run."""

    job_name: str = Field("factory-datagen", description="SLURM job name prefix; jobs are named '<prefix>-<run id>'.")
    cores: int = Field(1, ge=1, description="CPU cores per job (split over `processes` Dask worker processes).")
    memory: str = Field("4GB", description="Memory per job (Dask's notation, e.g. '16GB'); --mem and the worker limit.")
    processes: int = Field(1, ge=1, description="Dask worker processes per job.")
    walltime: str = Field("04:00:00", description="SLURM --time per job.")
    partition: str | None = Field(None, description="SLURM partition (-p).")
    account: str | None = Field(None, description="SLURM account (-A).")
    qos: str | None = Field(None, description="SLURM QOS (--qos).")
    extra_directives: list[str] = Field(default_factory=list,
                                        description="More '#SBATCH' options, e.g. '--gpus-per-node=8', '--exclusive'.")
    prologue: list[str] = Field(default_factory=list,
                                description="Shell lines run in each job before the worker (modules, venv, a server).")
    environment: dict[str, str] = Field(default_factory=dict, description="Variables exported in each job.")
    project_dir: str | None = Field(None, description="Checkout the workers import (a shared path); default: the flow's.")
    python: str | None = Field(None, description="Python on the nodes; default: the flow's interpreter.")
    interface: str | None = Field(None, description="Network interface of scheduler and workers (e.g. 'ib0').")
    prefect_api_url: str | None = Field(None, description="PREFECT_API_URL the workers report to; default: the flow's.")
    log_dir: str = Field("logs", description="Job logs: <log_dir>/<job id>/worker.log and <log_dir>/slurm-<job id>.out.")
    local_directory: str | None = Field(None, description="Dask worker scratch directory (node-local disk).")
    min_jobs: int = Field(1, ge=0, description="Jobs the adaptive cluster keeps even when idle.")
    max_jobs: int = Field(4, ge=1, description="Most jobs the adaptive cluster runs at once.")
    worker_lifetime: str | None = Field(
        None, description="Workers leave after this long (e.g. '55m' under a 1 h walltime) and the cluster submits "
                          "replacements, so running tasks are not killed by the walltime.")
    lifetime_stagger: str = Field("4m", description="Random spread of worker_lifetime, so workers do not leave at once.")
    node_server_command: str | None = Field(
        None, description="Inference server each job starts on its node before the worker ({port} is a free port), "
                          "e.g. SGLang on GPU nodes; tasks with openai.base_url http://node-local/v1 sample from it.")
    node_server_timeout_s: int = Field(1800, ge=1, description="Seconds the prologue waits for the node server's /health.")
    death_timeout_s: int = Field(120, ge=1, description="A worker that cannot reach the scheduler this long exits "
                                                         "(its job ends: no orphaned jobs after the flow dies).")

    @field_validator("extra_directives")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for option in value:
            if not option.startswith("-"):
                raise ValueError(f"extra_directives entry {option!r} must be an sbatch option such as '--exclusive'")
        return value

    @field_validator("max_jobs")
    @classmethod
    def _max_jobs(cls, value: int, info: Any) -> int:
        minimum = info.data.get("min_jobs", 0)
        if value < minimum:
            raise ValueError(f"max_jobs ({value}) is below min_jobs ({minimum}); raise max_jobs or lower min_jobs")
        return value


def run_job_name(prefix: str, run_id: str | None) -> str:
    """`<prefix>-<run id>` with characters SLURM and shells handle everywhere ([A-Za-z0-9_.-])."""
    name = f"{prefix}-{run_id}" if run_id else prefix
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:120]


def prologue_lines(spec: SlurmClusterSpec, *, log_dir: Path, project_dir: Path, api_url: str | None) -> list[str]:
    """Shell lines before the worker: per-job log directory, project on PYTHONPATH, environment, user lines."""
    lines = [
        f"mkdir -p {shlex.quote(str(log_dir))}/$SLURM_JOB_ID",
        f"exec >>{shlex.quote(str(log_dir))}/$SLURM_JOB_ID/worker.log 2>&1",
        'echo "factory worker job $SLURM_JOB_ID on $(hostname) at $(date -u +%FT%TZ)"',
        f"export FACTORY_JOB_LOG_DIR={shlex.quote(str(log_dir))}/$SLURM_JOB_ID",
        f"cd {shlex.quote(str(project_dir))}",
        f'export PYTHONPATH={shlex.quote(str(project_dir))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
    ]
    if api_url:
        lines.append(f"export PREFECT_API_URL={shlex.quote(api_url)}")
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.environment.items()]
    lines += list(spec.prologue)
    if spec.node_server_command:
        lines += node_server_lines(spec.node_server_command, spec.python or sys.executable, spec.node_server_timeout_s)
    return lines


NODE_ENDPOINT_VAR = "FACTORY_NODE_ENDPOINT"
"""Set in a worker job to the URL of the inference server its prologue started on the node."""


def node_server_lines(command: str, python: str, timeout_s: int) -> list[str]:
    """Start `command` on a free port in the background, wait for /health, export its URL; stop it when the job ends.

    A server that exits or stays unhealthy ends the job with its log's tail in worker.log (the cluster then
    submits another job), so no worker ever takes tasks without its server.
    """
    py = shlex.quote(python)
    try:
        server = command.format(port="$FACTORY_NODE_PORT")
    except (KeyError, IndexError) as error:
        raise ValueError(f"node_server_command {command!r} uses an unknown placeholder {error}; only {{port}}") from None
    return [
        f'FACTORY_NODE_PORT=$({py} -c "import socket; s = socket.socket(); s.bind((\'\', 0)); '
        f'print(s.getsockname()[1])")',
        f"{server} >$FACTORY_JOB_LOG_DIR/server.log 2>&1 &",
        "FACTORY_NODE_SERVER_PID=$!",
        "trap 'kill $FACTORY_NODE_SERVER_PID 2>/dev/null' EXIT",
        f'export {NODE_ENDPOINT_VAR}="http://127.0.0.1:$FACTORY_NODE_PORT"',  # the tasks run on this node
        f"{py} -m factory.slurm_cluster wait-healthy ${NODE_ENDPOINT_VAR} --pid $FACTORY_NODE_SERVER_PID "
        f"--timeout {timeout_s} --log $FACTORY_JOB_LOG_DIR/server.log || exit 1",
    ]


def wait_healthy(url: str, *, pid: int | None, timeout_s: float, log: str | None = None) -> str | None:
    """None once `url`/health answers 200; else why not (the server process exited, or the time ran out)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid is not None and not Path(f"/proc/{pid}").exists():
            reason = f"node inference server (pid {pid}) exited before {url} was healthy"
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(1)
    else:
        reason = f"node inference server not healthy at {url} within {timeout_s:.0f} s"
    tail = Path(log).read_text(errors="replace")[-2000:] if log and Path(log).is_file() else "(no log)"
    return f"{reason}; last lines of {log}:\n{tail}"


NODE_LOCAL_HOST = "node-local"
"""Host name in openai.base_url that stands for the worker's own node server: `http://node-local/v1`."""


def resolve_node_local(base_url: str | list[str]) -> str | list[str]:
    """Point `http://node-local/...` URLs at this worker's node server (FACTORY_NODE_ENDPOINT); others unchanged."""
    from urllib.parse import urlsplit

    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not any(urlsplit(url).netloc == NODE_LOCAL_HOST for url in urls):
        return base_url
    endpoint = os.environ.get(NODE_ENDPOINT_VAR)
    if not endpoint:
        raise RuntimeError(f"openai.base_url names http://{NODE_LOCAL_HOST} but this worker (host "
                           f"{socket.gethostname()}) has no {NODE_ENDPOINT_VAR}: set node_server_command in the "
                           "SLURM cluster block, or give the endpoints' URLs")
    resolved = [endpoint.rstrip("/") + urlsplit(url).path if urlsplit(url).netloc == NODE_LOCAL_HOST else url
                for url in urls]
    return resolved[0] if isinstance(base_url, str) else resolved


def cluster_kwargs(spec: SlurmClusterSpec, *, run_id: str | None = None) -> dict[str, Any]:
    """Keyword arguments of `dask_jobqueue.SLURMCluster` for `spec`, with jobs named for `run_id`."""
    log_dir = Path(spec.log_dir).absolute()
    log_dir.mkdir(parents=True, exist_ok=True)  # SLURM does not create it, and a job without its --output fails
    project_dir = Path(spec.project_dir or PROJECT_ROOT).absolute()
    api_url = spec.prefect_api_url or os.environ.get("PREFECT_API_URL")
    directives = [f"--output={log_dir}/slurm-%j.out"]
    if spec.qos:
        directives.append(f"--qos={spec.qos}")
    worker_args = []
    if spec.worker_lifetime:
        worker_args = ["--lifetime", spec.worker_lifetime, "--lifetime-stagger", spec.lifetime_stagger]
    kwargs: dict[str, Any] = {
        "job_name": run_job_name(spec.job_name, run_id),
        "cores": spec.cores,
        "memory": spec.memory,
        "processes": spec.processes,
        "walltime": spec.walltime,
        "queue": spec.partition,
        "account": spec.account,
        "job_extra_directives": directives + list(spec.extra_directives),
        "job_script_prologue": prologue_lines(spec, log_dir=log_dir, project_dir=project_dir, api_url=api_url),
        "worker_extra_args": worker_args,
        "python": spec.python or sys.executable,
        "death_timeout": spec.death_timeout_s,
        "scheduler_options": {"dashboard_address": ":0"},  # a free port: several runs on one head node
    }
    if spec.interface:
        kwargs["interface"] = spec.interface
    if spec.local_directory:
        kwargs["local_directory"] = spec.local_directory
    return kwargs


def adapt_kwargs(spec: SlurmClusterSpec) -> dict[str, int]:
    """`JobQueueCluster.adapt` bounds in jobs: lost or expired jobs are replaced up to `max_jobs`."""
    return {"minimum_jobs": spec.min_jobs, "maximum_jobs": spec.max_jobs}


def job_script(spec: SlurmClusterSpec, *, run_id: str | None = None) -> str:
    """The sbatch script dask-jobqueue would submit for `spec` (for review; starts a scheduler briefly)."""
    from dask_jobqueue import SLURMCluster

    with SLURMCluster(**cluster_kwargs(spec, run_id=run_id)) as cluster:
        return cluster.job_script()


class ClusterFault(RuntimeError):
    """Worker jobs that cannot work as configured (sbatch refuses them, workers die on start-up); retries cannot help."""


def check_submittable(kwargs: dict[str, Any]) -> None:
    """Ask `sbatch --test-only` about the job script the cluster will submit; raise ClusterFault with sbatch's words.

    A partition, account or QOS that does not exist (or a request no node can meet) is refused here in a second,
    instead of inside dask-jobqueue's adaptive loop, which logs the error once and then waits for workers forever.
    """
    if shutil.which("sbatch") is None:
        raise ClusterFault("sbatch is not on PATH: run the flow (its work pool's worker) on a node where SLURM's "
                           "commands work, e.g. the login node")
    from dask_jobqueue.slurm import SLURMJob

    job_kwargs = {key: value for key, value in kwargs.items() if key != "scheduler_options"}
    script = SLURMJob(scheduler="tcp://127.0.0.1:1", name="check", **job_kwargs).job_script()
    try:
        done = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ClusterFault("sbatch --test-only did not answer within 60 s: is the SLURM controller up "
                           "(`sinfo`)?") from None
    if done.returncode != 0:
        words = "; ".join(line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip())
        asked = ", ".join(f"{key}={kwargs.get(key)!r}" for key in ("queue", "account") if kwargs.get(key))
        asked = ", ".join(filter(None, [asked, *[d for d in kwargs.get("job_extra_directives", []) if "qos" in d]]))
        raise ClusterFault(f"SLURM refuses the worker jobs ({asked or 'default partition'}; fix the cluster block's "
                           f"partition/account/qos/resources): {words or f'sbatch exited {done.returncode}'}")


ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*|.*\b(error|No such file|not found|Permission denied)\b.*",
                        re.IGNORECASE)


def first_error(log: Path) -> str:
    """The line of a worker.log that says why the worker stopped: its last exception line, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    exceptions = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    if exceptions:
        return exceptions[-1]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or ["(empty log)"])[-1]


def queue_states(job_name: str) -> dict[str, tuple[str, str]]:
    """{job id: (state, node)} of this user's queued or running jobs called `job_name` ({} if squeue fails)."""
    try:
        done = subprocess.run(["squeue", "-h", "--name", job_name, "--user", _user(), "-o", "%i %T %N"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return states


class JobWatch:
    """Follows an adaptive SLURMCluster from a thread: logs each job as it is submitted and its worker as it joins
    and leaves (SLURM job id, node), and records a fault when a job ends before its worker ever joined.

    A job that ran and ended without its worker joining the scheduler died on start-up (the python on the node
    lacks the environment, a prologue line exits, an import fails): the same job script fails the same way every
    time, so the run should stop with that worker's error rather than wait for a worker that never comes.
    """

    def __init__(self, cluster: Any, *, job_name: str, log_dir: Path, log: Callable[[str], None],
                 interval_s: float = 1.0) -> None:
        self.cluster, self.job_name, self.log_dir, self.log = cluster, job_name, Path(log_dir), log
        self.interval_s = interval_s
        self.fault: str | None = None
        self.closing = False
        self.jobs: dict[str, dict[str, Any]] = {}
        """job id -> {"name": worker name, "node": node or None, "joined": bool, "ended": bool}."""
        self._workers: dict[str, str] = {}  # address of a joined worker -> its job id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _snapshot(self) -> tuple[dict[str, str], dict[str, Any], set[str]]:
        jobs = {name: str(job.job_id) for name, job in list(self.cluster.workers.items())
                if getattr(job, "job_id", None)}
        workers = dict(self.cluster.scheduler_info.get("workers", {}))
        wanted = set(self.cluster.worker_spec)  # scaling down drops a job from the spec before cancelling it
        return jobs, workers, wanted

    def poll(self) -> None:
        """One look at the cluster's jobs, the scheduler's workers and squeue; logs what changed."""
        jobs, workers, wanted = self._snapshot()
        queue = queue_states(self.job_name)
        for name, job_id in jobs.items():
            if job_id not in self.jobs:
                self.jobs[job_id] = {"name": name, "node": None, "joined": False, "ended": False}
                self.log(f"SLURM job {job_id} submitted for Dask worker {name} ({queue.get(job_id, ('?',))[0]})")
        for address, info in workers.items():
            if address in self._workers:
                continue
            name = str(info.get("name", ""))
            job_id = jobs.get(name) or jobs.get(name.rsplit("-", 1)[0])  # processes > 1: '<job's name>-<i>'
            if job_id is None:
                continue
            job = self.jobs.setdefault(job_id, {"name": name, "node": None, "joined": False, "ended": False})
            job["joined"] = True
            job["node"] = queue.get(job_id, ("", ""))[1] or info.get("host")
            self._workers[address] = job_id
            self.log(f"worker joined: SLURM job {job_id} on node {job['node']} ({name}, {address})")
        for address in [a for a in self._workers if a not in workers]:
            job_id = self._workers.pop(address)
            state = queue.get(job_id, ("ended",))[0]
            self.log(f"worker left: SLURM job {job_id} on node {self.jobs[job_id]['node']} (job {state.lower()})")
        for job_id, job in self.jobs.items():
            if job["ended"] or job_id in queue:
                continue
            job["ended"] = True
            log = self.log_dir / job_id / "worker.log"
            held = job["name"] in wanted  # the cluster still counts on it: it did not scale this job away
            if not job["joined"] and held and log.is_file() and not self.closing and self.fault is None:
                self.fault = (f"SLURM job {job_id} ended before its Dask worker joined (log {log}); the worker's "
                              f"error: {first_error(log)}")
                self.log(self.fault)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 - watching must never take the run down
                logger.debug("job watch: %s", error)

    def start(self) -> JobWatch:
        # The caller's context (a flow run's settings and logger): a bare thread would see none, and a Prefect
        # log call from it would start a temporary server of its own.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="slurm-job-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _close_all_workers(dask_scheduler: Any) -> None:
    for address in list(dask_scheduler.workers):
        dask_scheduler.close_worker(address)  # the worker, then its nanny, exit; the job script ends


def retire_workers(client: Any, cluster: Any, *, job_name: str, timeout_s: float = 20.0) -> None:
    """Stop adapting and let every worker exit by itself, so jobs end COMPLETED rather than CANCELLED by scancel.

    Workers of jobs that were still starting join later; they are closed as they join, until no job is left or
    `timeout_s` has passed (the cluster's close then cancels the rest).
    """
    adaptive = getattr(cluster, "_adaptive", None)
    if adaptive is not None:
        adaptive.stop()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # Not client.retire_workers: it refuses a worker that holds results no other worker can take over.
            client.run_on_scheduler(_close_all_workers)
        except Exception as error:  # noqa: BLE001 - the cluster's close cancels what is left
            logger.warning("could not close the Dask workers (%s); their jobs are cancelled instead", error)
            return
        if time.monotonic() >= deadline or not queue_states(job_name):
            return
        time.sleep(0.5)


def worker_identity() -> dict[str, Any]:
    """Where this process runs: host, SLURM job id (None outside SLURM) and pid, recorded in chunk stats."""
    return {"host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid()}


def _user() -> str:
    import getpass

    return getpass.getuser()


def _squeue_names(name: str) -> list[str]:
    done = subprocess.run(["squeue", "-h", "--name", name, "--user", _user(), "-o", "%i"], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:  # SLURM down: no job can be listed or submitted, and a retry in 30 s rarely helps
        raise ClusterFault(f"squeue failed (exit {done.returncode}; is the SLURM controller up? try sinfo): "
                           f"{' '.join(done.stderr.split())[-300:]}")
    return done.stdout.split()


def jobs_named(name: str) -> list[str]:
    """Ids of this user's queued or running jobs called `name` (empty without SLURM)."""
    if shutil.which("squeue") is None:
        return []
    return _squeue_names(name)


def cancel_jobs_named(name: str, why: str = "left by an earlier run") -> list[str]:
    """Cancel every job called `name` (e.g. left by a killed flow of the same run); returns their ids."""
    jobs = jobs_named(name)
    if jobs:
        done = subprocess.run(["scancel", "--name", name, "--user", _user()], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"scancel --name {name} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        logger.warning("cancelled %d SLURM job(s) named %s %s: %s", len(jobs), name, why, ", ".join(jobs))
    return jobs


def main(argv: list[str] | None = None) -> int:
    """`python -m factory.slurm_cluster wait-healthy URL --pid P --timeout S` (job prologues) and `cancel NAME`."""
    import argparse

    parser = argparse.ArgumentParser(description="Helpers for factory worker jobs on SLURM.")
    commands = parser.add_subparsers(dest="command", required=True)
    wait = commands.add_parser("wait-healthy", help="wait until URL/health answers (a node server in a prologue)")
    wait.add_argument("url")
    wait.add_argument("--pid", type=int, default=None, help="give up when this process exits")
    wait.add_argument("--timeout", type=float, default=1800.0)
    wait.add_argument("--log", default=None, help="log whose tail is printed on failure")
    cancel = commands.add_parser("cancel", help="cancel this user's jobs called NAME (e.g. factory-datagen-<run id>)")
    cancel.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "cancel":
        print(" ".join(cancel_jobs_named(args.name)) or f"no jobs named {args.name}")
        return 0
    problem = wait_healthy(args.url, pid=args.pid, timeout_s=args.timeout, log=args.log)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"node inference server healthy at {args.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
