"""The SLURM worker jobs a SlurmClusterSpec / SlurmClusterBlock describes: the sbatch script dask-jobqueue submits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from factory.slurm_cluster import (
    PROJECT_ROOT, SlurmClusterSpec, adapt_kwargs, cluster_kwargs, job_script, run_job_name, worker_identity,
)


@pytest.fixture
def spec(tmp_path: Path) -> SlurmClusterSpec:
    return SlurmClusterSpec(
        cores=16, memory="200GB", processes=2, walltime="01:00:00", partition="gpu", account="rl", qos="high",
        extra_directives=["--gpus-per-node=8", "--exclusive"], prologue=["module load cuda"],
        environment={"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path / "logs"), prefect_api_url="http://head:4200/api",
        worker_lifetime="55m", lifetime_stagger="4m", min_jobs=1, max_jobs=8)


def test_job_script_carries_every_setting(spec: SlurmClusterSpec, tmp_path: Path) -> None:
    script = job_script(spec, run_id="intern-bootcamp")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH -J factory-datagen-intern-bootcamp" in header
    for line in ("#SBATCH -p gpu", "#SBATCH -A rl", "#SBATCH --qos=high", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --mem=187G", "#SBATCH -t 01:00:00", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive",
                 f"#SBATCH --output={tmp_path / 'logs'}/slurm-%j.out"):
        assert line in header, (line, header)
    body = script.split("\n", 1)[1]
    # The prologue runs first, in order: per-job log dir, project importable, API, environment, the user's lines.
    order = [f"exec >>{tmp_path / 'logs'}/$SLURM_JOB_ID/worker.log 2>&1", f"cd {PROJECT_ROOT}",
             f'export PYTHONPATH={PROJECT_ROOT}"${{PYTHONPATH:+:$PYTHONPATH}}"',
             "export PREFECT_API_URL=http://head:4200/api", "export OMP_NUM_THREADS=1", "module load cuda",
             f"{sys.executable} -m distributed.cli.dask_worker"]
    positions = [body.index(part) for part in order]
    assert positions == sorted(positions)
    worker = next(line for line in body.splitlines() if "dask_worker" in line)
    assert "--nworkers 2" in worker and "--nthreads 8" in worker
    assert "--lifetime 55m --lifetime-stagger 4m" in worker and "--death-timeout 120" in worker
    assert "--lifetime-restart" not in worker  # a worker that leaves ends its job; adapt submits a fresh one


def test_defaults_are_a_small_job_with_no_optional_directives(tmp_path: Path) -> None:
    script = job_script(SlurmClusterSpec(log_dir=str(tmp_path)), run_id=None)
    assert "#SBATCH -J factory-datagen\n" in script
    assert "#SBATCH -p" not in script and "#SBATCH -A" not in script and "--qos" not in script
    assert "--lifetime" not in script and "#SBATCH --cpus-per-task=1" in script


def test_adaptive_bounds_are_in_jobs(spec: SlurmClusterSpec) -> None:
    assert adapt_kwargs(spec) == {"minimum_jobs": 1, "maximum_jobs": 8}
    with pytest.raises(ValidationError, match="max_jobs"):
        SlurmClusterSpec(min_jobs=3, max_jobs=2)


def test_bad_directive_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="must be an sbatch option"):
        SlurmClusterSpec(extra_directives=["exclusive"])


def test_job_names_are_run_scoped_and_shell_safe() -> None:
    assert run_job_name("factory-datagen", "run 1/a") == "factory-datagen-run_1_a"
    assert run_job_name("p", None) == "p"
    assert cluster_kwargs(SlurmClusterSpec(), run_id="r")["job_name"] == "factory-datagen-r"


def test_relative_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    kwargs = cluster_kwargs(SlurmClusterSpec(log_dir="logs", project_dir="code"))
    assert f"--output={tmp_path}/logs/slurm-%j.out" in kwargs["job_extra_directives"]
    assert f"cd {tmp_path}/code" in kwargs["job_script_prologue"]


def test_block_has_the_spec_fields_and_builds_a_dask_task_runner(spec: SlurmClusterSpec,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import blocks.slurm as slurm_block

    cancelled = []
    checked = []
    monkeypatch.setattr(slurm_block, "cancel_jobs_named", cancelled.append)
    monkeypatch.setattr(slurm_block, "check_submittable", checked.append)
    block = slurm_block.SlurmClusterBlock(**spec.model_dump())
    assert block.spec() == spec
    runner = block.task_runner(run_id="r1")
    assert runner.cluster_class == "factory.slurm_jobs.GracefulSLURMCluster"
    assert checked == [runner.cluster_kwargs]  # sbatch --test-only of the job script before the cluster starts
    assert runner.duplicate().log_dir == runner.log_dir  # the flow engine runs a duplicate
    assert runner.cluster_kwargs["job_name"] == "factory-datagen-r1" and runner.cluster_kwargs["cores"] == 16
    assert runner.adapt_kwargs == {"minimum_jobs": 1, "maximum_jobs": 8}
    assert cancelled == ["factory-datagen-r1"]  # leftovers of a killed run with the same id are cancelled first


def test_worker_identity_names_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert worker_identity()["slurm_job_id"] == "42"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert worker_identity()["slurm_job_id"] is None


def test_node_server_starts_before_the_worker_and_is_waited_for(tmp_path: Path) -> None:
    spec = SlurmClusterSpec(log_dir=str(tmp_path), node_server_command="python -m factory.inference.local_server "
                            "--model models/starter-policy --port {port}", node_server_timeout_s=600)
    lines = cluster_kwargs(spec)["job_script_prologue"]
    start = next(i for i, line in enumerate(lines) if "local_server" in line)
    assert "--port $FACTORY_NODE_PORT >$FACTORY_JOB_LOG_DIR/server.log 2>&1 &" in lines[start]
    wait = next(i for i, line in enumerate(lines) if "wait-healthy" in line)
    assert wait > start and "--timeout 600" in lines[wait] and lines[wait].endswith("|| exit 1")
    assert 'export FACTORY_NODE_ENDPOINT="http://127.0.0.1:$FACTORY_NODE_PORT"' in lines
    with pytest.raises(ValueError, match="unknown placeholder"):
        cluster_kwargs(SlurmClusterSpec(node_server_command="serve --port {prt}"))


def test_node_local_base_url_resolves_to_the_workers_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.slurm_cluster import resolve_node_local

    monkeypatch.delenv("FACTORY_NODE_ENDPOINT", raising=False)
    assert resolve_node_local("http://a:1/v1") == "http://a:1/v1"
    with pytest.raises(RuntimeError, match="node_server_command"):
        resolve_node_local("http://node-local/v1")
    monkeypatch.setenv("FACTORY_NODE_ENDPOINT", "http://node7:31000")
    assert resolve_node_local("http://node-local/v1") == "http://node7:31000/v1"
    assert resolve_node_local(["http://node-local", "http://b:2/v1"]) == ["http://node7:31000", "http://b:2/v1"]


def test_wait_healthy_reports_a_server_that_died_with_its_log(tmp_path: Path) -> None:
    import subprocess

    from factory.slurm_cluster import wait_healthy

    log = tmp_path / "server.log"
    log.write_text("OSError: no model at models/x\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    problem = wait_healthy("http://127.0.0.1:9", pid=dead.pid, timeout_s=30, log=str(log))
    assert problem is not None and "exited before" in problem and "no model at models/x" in problem
    assert "within 1 s" in wait_healthy("http://127.0.0.1:9", pid=None, timeout_s=1)


def test_cluster_deployment_is_the_seed_job_on_slurm_blocks() -> None:
    import yaml

    from flows.datagen import ENVIRONMENTS, build_job_config

    deployments = {d["name"]: d for d in yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]}
    slurm = deployments["intern-bootcamp-datagen-slurm"]
    assert slurm["entrypoint"] == deployments["intern-bootcamp-datagen"]["entrypoint"]  # same flow, other blocks
    params = slurm["parameters"]
    cfg = build_job_config(ENVIRONMENTS["intern_bootcamp"], config_path=str(PROJECT_ROOT / params["config_path"]),
                           values={k: params[k] for k in ("env", "datagen")})
    assert (cfg.env.group_size, cfg.env.total_items, cfg.datagen.chunk_items) == (16, 1000, 100)
    assert cfg.datagen.task_runner_block == "factory-slurm-cluster/datagen-nodes"
    assert cfg.datagen.endpoints_block == "sglang-endpoints"


def test_deployment_entrypoints_are_module_paths_that_every_worker_imports_by_the_same_name() -> None:
    """`flows/datagen.py:f` would load the file as module `datagen`, which Dask/SLURM workers cannot unpickle."""
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    for deployment in yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]:
        module, _, name = deployment["entrypoint"].partition(":")
        assert "/" not in module and not module.endswith(".py"), deployment["name"]
        flow = load_flow_from_entrypoint(deployment["entrypoint"], use_placeholder_flow=False)
        assert flow.fn.__module__ == module and flow.fn.__name__ == name, deployment["name"]


def test_a_flow_loaded_from_a_file_path_is_refused_before_it_reaches_dask_workers() -> None:
    from factory.preflight import PreflightError
    from flows.datagen import DatagenSettings
    from factory.datagen.runtime import check_importable_by_workers

    check_importable_by_workers(DatagenSettings(task_runner="dask"), "flows.datagen")
    check_importable_by_workers(DatagenSettings(), "datagen")  # threads share the flow's own modules
    for settings in (DatagenSettings(task_runner="dask"), DatagenSettings(task_runner_block="factory-slurm-cluster/x")):
        with pytest.raises(PreflightError, match="entrypoint: flows.datagen:intern_bootcamp_datagen"):
            check_importable_by_workers(settings, "datagen")


class _Cluster:
    """What JobWatch reads from a dask-jobqueue cluster: its jobs, their spec, the scheduler's workers."""

    def __init__(self) -> None:
        self.workers: dict[str, object] = {}
        self.worker_spec: dict[str, dict] = {}
        self.scheduler_info: dict[str, dict] = {"workers": {}}

    def submit(self, name: str, job_id: str) -> None:
        from types import SimpleNamespace

        self.workers[name] = SimpleNamespace(job_id=job_id)
        self.worker_spec[name] = {}


def test_job_watch_logs_jobs_and_nodes_as_workers_join_and_leave(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import factory.slurm_cluster as sc

    queue: dict[str, tuple[str, str]] = {}
    monkeypatch.setattr(sc, "queue_states", lambda name: dict(queue))
    cluster, lines = _Cluster(), []
    watch = sc.JobWatch(cluster, job_name="factory-datagen-r", log_dir=tmp_path, log=lines.append)
    cluster.submit("SLURMCluster-0", "41")
    queue["41"] = ("PENDING", "")
    watch.poll()
    queue["41"] = ("RUNNING", "node7")
    cluster.scheduler_info["workers"]["tcp://10.0.0.7:4000"] = {"name": "SLURMCluster-0", "host": "10.0.0.7"}
    watch.poll()
    del cluster.scheduler_info["workers"]["tcp://10.0.0.7:4000"]
    del queue["41"]
    watch.poll()
    assert lines == ["SLURM job 41 submitted for Dask worker SLURMCluster-0 (PENDING)",
                     "worker joined: SLURM job 41 on node node7 (SLURMCluster-0, tcp://10.0.0.7:4000)",
                     "worker left: SLURM job 41 on node node7 (job ended)"]
    assert watch.fault is None  # its worker had joined: a job that ends after work is no start-up fault


def test_job_watch_faults_on_a_job_that_ended_before_its_worker_joined(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    import factory.slurm_cluster as sc

    queue = {"7": ("RUNNING", "node1"), "8": ("RUNNING", "node1")}
    monkeypatch.setattr(sc, "queue_states", lambda name: dict(queue))
    cluster = _Cluster()
    watch = sc.JobWatch(cluster, job_name="j", log_dir=tmp_path, log=lambda line: None)
    cluster.submit("SLURMCluster-0", "7")
    cluster.submit("SLURMCluster-1", "8")
    watch.poll()
    # Job 8 is scaled away (out of the spec) and cancelled: not a fault, even with a log.
    del cluster.worker_spec["SLURMCluster-1"], queue["8"]
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "worker.log").write_text("RuntimeError: Nanny failed to start.\n")
    watch.poll()
    assert watch.fault is None
    # Job 7 ends on its own, its worker never having joined: the run stops with the worker's error.
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "worker.log").write_text("factory worker job 7 on node1\n/usr/bin/python: Error while finding "
                                               "module specification for 'distributed.cli.dask_worker' "
                                               "(ModuleNotFoundError: No module named 'distributed')\n")
    del queue["7"]
    watch.poll()
    assert watch.fault is not None and watch.fault.startswith("SLURM job 7 ended before its Dask worker joined")
    assert watch.fault.endswith("(ModuleNotFoundError: No module named 'distributed')")


def test_first_error_is_the_exception_line_or_the_last_line(tmp_path: Path) -> None:
    from factory.slurm_cluster import first_error

    log = tmp_path / "worker.log"
    log.write_text("start\nTraceback (most recent call last):\n  File \"x.py\", line 1\nImportError: cannot import "
                   "name 'y'\n2026-11-25 - distributed.nanny - INFO - closed\n")
    assert first_error(log) == "ImportError: cannot import name 'y'"
    log.write_text("start\n/etc/prologue.sh: line 3: module: command not found\n")
    assert first_error(log) == "/etc/prologue.sh: line 3: module: command not found"
    log.write_text("only this\n")
    assert first_error(log) == "only this"


def test_a_job_script_sbatch_refuses_is_a_cluster_fault_ending_in_sbatchs_words(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    from factory.slurm_cluster import ClusterFault, check_submittable

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"  # SLURM's answer to a partition it does not have; the script arrives on stdin
    sbatch.write_text(f"#!/bin/sh\ncat > {tmp_path}/script\necho 'sbatch: error: invalid partition specified: gpu' >&2\n"
                      "echo 'allocation failure: Invalid partition name specified' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    kwargs = cluster_kwargs(SlurmClusterSpec(partition="gpu", qos="high", log_dir=str(tmp_path / "logs")), run_id="r")
    with pytest.raises(ClusterFault) as raised:
        check_submittable(kwargs)
    assert str(raised.value).startswith("SLURM refuses the worker jobs (queue='gpu', --qos=high;")
    assert str(raised.value).endswith("sbatch: error: invalid partition specified: gpu; allocation failure: Invalid "
                                      "partition name specified")
    script = (tmp_path / "script").read_text()
    assert "#SBATCH -p gpu" in script and "#SBATCH --qos=high" in script and "distributed.cli.dask_worker" in script


def test_slurm_down_is_a_cluster_fault_with_squeues_words(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from factory.slurm_cluster import ClusterFault, cancel_jobs_named

    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' "
                      ">&2\nexit 1\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(ClusterFault, match=r"is the SLURM controller up\? try sinfo\): slurm_load_jobs error: Unable "
                                           r"to contact slurm controller \(connect failure\)$"):
        cancel_jobs_named("factory-datagen-r")
