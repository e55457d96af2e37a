"""Start SGLang servers (or any stand-in with the same HTTP API) as SLURM jobs, wait until healthy, tear down.

Plain functions and one class, no Prefect: `flows/inference.py` wraps them in
tasks, `blocks/inference.py` stores the spec. Each replica is one `sbatch` job
on one node (tp x dp GPUs). The job writes `http://<host>:<port>` to an
endpoint file in the run directory (a shared filesystem), then execs the
server; the launcher reads those files and polls `/health`. With `use_router`
an `sglang_router` job fronts the healthy replicas and is the one endpoint.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from string import Template

import httpx
from pydantic import Field, field_validator

from factory.config import FactoryConfig

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parents[2] / "deployments" / "slurm"
SGLANG_COMMAND = ("python -m sglang.launch_server --model-path {model_path} --tp-size {tp} --dp-size {dp} "
                  "--host {host} --port {port} --mem-fraction-static {mem_fraction_static}")
LOCAL_COMMAND = "python -m factory.inference.local_server --model {model_path} --host {host} --port {port}"
ROUTER_COMMAND = "python -m sglang_router.launch_router --host {host} --port {port} --worker-urls {worker_urls}"


class SGLangLaunchSpec(FactoryConfig):
    """What to serve and where: model, parallelism, ports and the SLURM resources of each replica."""

    model_path: str = Field(description="HF model directory or hub id the servers load.")
    replicas: int = Field(1, ge=1, description="Server jobs to start (one node each).")
    tp: int = Field(1, ge=1, description="Tensor-parallel size per replica (--tp-size).")
    dp: int = Field(1, ge=1, description="Data-parallel size per replica (--dp-size).")
    port: int = Field(30000, ge=1, le=65535, description="Port of replica 0; replica i listens on port + i.")
    host: str = Field("0.0.0.0", description="Interface the servers bind to.")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="SGLang --mem-fraction-static.")
    extra_server_args: list[str] = Field(default_factory=list, description="More arguments for the server command.")
    launch_command: str | None = Field(
        None, description="Replaces the sglang.launch_server command; placeholders {model_path} {tp} {dp} {host} "
                          "{port} {mem_fraction_static} (e.g. the local CPU server for tests).")
    partition: str | None = Field(None, description="SLURM partition (--partition).")
    account: str | None = Field(None, description="SLURM account (--account).")
    qos: str | None = Field(None, description="SLURM QOS (--qos).")
    time_limit: str = Field("04:00:00", description="SLURM --time per job.")
    gpus_per_node: int | None = Field(None, ge=0, description="GPUs per job (--gpus-per-node); default tp * dp.")
    cpus_per_task: int | None = Field(None, ge=1, description="SLURM --cpus-per-task.")
    mem: str | None = Field(None, description="SLURM --mem (e.g. '200G').")
    extra_sbatch: list[str] = Field(default_factory=list, description="More '#SBATCH' options, e.g. '--exclusive'.")
    setup_commands: list[str] = Field(default_factory=list, description="Shell lines run before the server (modules, venv).")
    host_command: str = Field("hostname", description="Shell command that prints the host name clients reach.")
    use_router: bool = Field(False, description="Front the replicas with sglang_router; clients see one endpoint.")
    router_port: int = Field(30100, ge=1, le=65535, description="Port of the router.")
    router_command: str | None = Field(None, description="Replaces the sglang_router command ({host} {port} {worker_urls}).")
    health_timeout_s: float = Field(1800.0, gt=0, description="Seconds to wait for every replica to become healthy.")
    job_name: str = Field("factory-sglang", description="SLURM job name prefix.")

    @field_validator("extra_sbatch")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for option in value:
            if not option.startswith("-"):
                raise ValueError(f"extra_sbatch entry {option!r} must be an sbatch option such as '--exclusive'")
        return value

    def gpus(self) -> int:
        return self.tp * self.dp if self.gpus_per_node is None else self.gpus_per_node


def server_command(spec: SGLangLaunchSpec, replica: int) -> str:
    """The shell command one replica execs."""
    template = spec.launch_command or SGLANG_COMMAND
    values = {"model_path": spec.model_path, "tp": spec.tp, "dp": spec.dp, "host": spec.host,
              "port": spec.port + replica, "mem_fraction_static": spec.mem_fraction_static}
    try:
        command = template.format(**{k: shlex.quote(str(v)) for k, v in values.items()})
    except (KeyError, IndexError) as error:
        raise ValueError(f"launch_command {template!r} uses an unknown placeholder {error}; "
                         f"known: {', '.join('{' + k + '}' for k in values)}") from None
    return " ".join([command, *map(shlex.quote, spec.extra_server_args)])


def router_command(spec: SGLangLaunchSpec, worker_urls: list[str]) -> str:
    template = spec.router_command or ROUTER_COMMAND
    return template.format(host=shlex.quote(spec.host), port=spec.router_port,
                           worker_urls=" ".join(shlex.quote(u) for u in worker_urls))


def sbatch_lines(spec: SGLangLaunchSpec, *, gpus: int) -> str:
    options = [f"--partition={spec.partition}" if spec.partition else None,
               f"--account={spec.account}" if spec.account else None,
               f"--qos={spec.qos}" if spec.qos else None,
               f"--gpus-per-node={gpus}" if gpus else None,
               f"--cpus-per-task={spec.cpus_per_task}" if spec.cpus_per_task else None,
               f"--mem={spec.mem}" if spec.mem else None, *spec.extra_sbatch]
    return "\n".join(f"#SBATCH {o}" for o in options if o)


def render_job_script(spec: SGLangLaunchSpec, run_dir: Path, replica: int | None, command: str) -> str:
    """The sbatch script of replica `replica`, or of the router when `replica` is None."""
    router = replica is None
    name = "router" if router else f"server-{replica}"
    template = Template((TEMPLATES / ("sglang_router.sbatch" if router else "sglang_server.sbatch")).read_text())
    return template.substitute(
        job_name=f"{spec.job_name}-{name}", log_path=run_dir / f"{name}.log", time_limit=spec.time_limit,
        sbatch_lines=sbatch_lines(spec, gpus=0 if router else spec.gpus()),
        setup="\n".join(spec.setup_commands), host_command=spec.host_command,
        port=spec.router_port if router else spec.port + replica, endpoint_file=run_dir / f"{name}.endpoint",
        command=command,
    )


def parse_job_id(sbatch_output: str) -> str:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    job_id = sbatch_output.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch did not print a job id (got {sbatch_output.strip()!r})")
    return job_id


def _slurm(*args: str, timeout: float = 60) -> str:
    if shutil.which(args[0]) is None:
        raise RuntimeError(f"{args[0]} not found on PATH: run this on a SLURM login node (or install slurm-wlm)")
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def job_state(job_id: str) -> str | None:
    """SLURM state of a queued or running job (PENDING, RUNNING, ...), or None once it has left the queue."""
    state = _slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip()
    return state or None


class SGLangCluster:
    """Submit the replica jobs, wait until healthy, optionally add the router, cancel everything on stop."""

    def __init__(self, spec: SGLangLaunchSpec, run_dir: str | Path) -> None:
        self.spec, self.run_dir = spec, Path(run_dir)
        self.job_ids: list[str] = []
        self.endpoints: list[str] = []

    def submit(self, replica: int | None, command: str) -> str:
        name = "router" if replica is None else f"server-{replica}"
        script = render_job_script(self.spec, self.run_dir, replica, command)
        path = self.run_dir / f"{name}.sbatch"
        path.write_text(script)
        (self.run_dir / f"{name}.endpoint").unlink(missing_ok=True)
        job_id = parse_job_id(_slurm("sbatch", "--parsable", str(path)))
        self.job_ids.append(job_id)
        logger.info("submitted %s as SLURM job %s", name, job_id)
        return job_id

    def start(self) -> list[str]:
        """Submit all replicas (and the router), wait until healthy; returns the endpoints clients use."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.spec.health_timeout_s
        names = {self.submit(i, server_command(self.spec, i)): f"server-{i}" for i in range(self.spec.replicas)}
        workers = [self.wait_healthy(job_id, name, deadline) for job_id, name in names.items()]
        if self.spec.use_router:
            router_id = self.submit(None, router_command(self.spec, workers))
            self.endpoints = [self.wait_healthy(router_id, "router", deadline)]
        else:
            self.endpoints = workers
        return self.endpoints

    def wait_healthy(self, job_id: str, name: str, deadline: float) -> str:
        endpoint_file = self.run_dir / f"{name}.endpoint"
        while time.monotonic() < deadline:
            if job_state(job_id) is None:
                log = self.run_dir / f"{name}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
                raise RuntimeError(f"SLURM job {job_id} ({name}) ended before it was healthy; log {log}:\n{tail}")
            if endpoint_file.exists():
                url = endpoint_file.read_text().strip()
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        logger.info("%s (job %s) healthy at %s", name, job_id, url)
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(1)
        raise TimeoutError(f"SLURM job {job_id} ({name}) not healthy within {self.spec.health_timeout_s:.0f} s; "
                           f"see {self.run_dir / (name + '.log')} or raise health_timeout_s")

    def stop(self, wait_s: float = 60.0) -> None:
        """Cancel every job and wait (up to `wait_s`) until they have left the queue, so the ports are free."""
        if not self.job_ids:
            return
        try:
            _slurm("scancel", *self.job_ids)
            logger.info("cancelled SLURM jobs %s", ", ".join(self.job_ids))
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(job_state(j) is not None for j in self.job_ids):
                time.sleep(0.5)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            logger.warning("could not cancel SLURM jobs %s: %s", self.job_ids, error)
        self.job_ids = []

    def __enter__(self) -> list[str]:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
