"""Deployments run the way a user runs them: `prefect deploy`, a process worker, `prefect deployment run --watch`.

Each test works in a directory laid out like the checkout (prefect.yaml,
deployments/ and models/ linked in), so `./data` and `logs/` land in the test's
temp dir; the flows come from the package (module-path entrypoints), as in a
fresh clone with `pip install -e .`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from factory.store import ShardStore
from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def prefect(*args: str, env: dict[str, str], cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def checkout_like(tmp_path: Path) -> Path:
    """A directory where deployments run as from the checkout: what they read is linked, what they write is local."""
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("prefect.yaml", "deployments", "models"):
        (work / name).symlink_to(REPO / name)
    return work


def client_env(prefect_server: dict[str, str]) -> dict[str, str]:
    """The test's environment for the prefect CLI and worker: this checkout's code first on the path."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **prefect_server, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@contextmanager
def process_worker(pool: str, *, env: dict[str, str], cwd: Path, log: Path, argv: list[str] | None = None
                   ) -> Iterator[subprocess.Popen]:
    """`prefect worker start --pool POOL --type process` for the length of a block; SIGINT on exit."""
    argv = argv or [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    with open(log, "wb") as out:
        worker = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield worker
        finally:
            os.killpg(worker.pid, signal.SIGINT)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()


def run_logs() -> str:
    """Every log line of every flow run on the test's server (the deployment's run and its pipeline subflow)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        ids = [run.id for run in client.read_flow_runs(limit=200)]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), limit=200)
        offset = len(logs)
        while True:  # the API pages at 200
            more = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), limit=200,
                                    offset=offset)
            if not more:
                break
            logs += more
            offset += len(more)
    return "\n".join(log.message for log in sorted(logs, key=lambda log: log.timestamp))


def assert_every_item_once(data: Path, run_id: str, items: int) -> dict[str, Any]:
    """kept + dropped = items, no group twice, every shard intact; returns the run's summary."""
    store = ShardStore(data)
    assert store.verify(run_id) == []
    summary = json.loads((data / run_id / "stats-intern-bootcamp.json").read_text())
    groups = list(store.iter_groups(run_id))
    assert summary["groups_kept"] == len(groups)
    assert summary["groups_kept"] + sum(summary["dropped"].values()) == items, summary
    assert len({g.group_id for g in groups}) == len(groups) and len({g.item_key for g in groups}) == len(groups)
    return summary


def test_deployment_run_completes_and_its_shards_are_readable(prefect_server, tmp_path):
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy

    env = client_env(prefect_server)
    deployed = prefect("--no-prompt", "deploy", "--name", "intern-bootcamp-datagen", env=env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    model = make_tiny_policy(tmp_path / "policy")
    with process_worker("local-process", env=env, cwd=REPO, log=tmp_path / "worker.log"):
        with start_local_server(model) as server:
            params = {
                "env": {"group_size": 4, "total_items": 8, "max_tokens": 8, "tokenizer_name": str(model),
                        "ensure_scores_are_not_same": False},
                "openai": {"base_url": server.base_url},
                "datagen": {"store_root": str(tmp_path / "data"), "run_id": "deployed", "chunk_items": 4,
                            "score_workers": 1},
            }
            run = prefect("deployment", "run", "intern-bootcamp-datagen/intern-bootcamp-datagen",
                          "--params", json.dumps(params), "--watch", "--watch-timeout", "300", env=env, timeout=360)
            log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + log
            assert "Completed" in run.stdout
    store = ShardStore(tmp_path / "data")
    assert store.verify("deployed") == []
    groups = list(store.iter_groups("deployed"))
    assert len(groups) == 8 and all(g.group_size == 4 for g in groups)


class _Sick(BaseHTTPRequestHandler):
    """A model server that passes its health checks and answers every generation with HTTP 500."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # /health, /v1/models
        self._answer(200, b'{"data": []}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(500, b'{"error": "sick"}')


@contextmanager
def sick_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sick)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_dask_deployment_runs_its_chunks_in_worker_processes(prefect_server, tmp_path):
    """intern-bootcamp-datagen-dask: the flow pickled to Dask worker processes by its module name, chunks there;
    the project's warnings logged in those workers (a sick endpoint taken out of rotation) are on the run's log."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    from factory.inference.local_server import start_local_server

    env, work = client_env(prefect_server), checkout_like(tmp_path)
    deployed = prefect("--no-prompt", "deploy", "--name", "intern-bootcamp-datagen-dask", env=env, cwd=work)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with start_local_server(REPO / "models/starter-policy") as server, sick_server() as sick, \
            process_worker("local-process", env=env, cwd=work, log=tmp_path / "worker.log"):
        params = {"env": {"group_size": 4, "total_items": 12, "max_tokens": 8},
                  "openai": {"base_url": [server.base_url, sick]},
                  "datagen": {"run_id": "dask-trial", "chunk_items": 3, "task_runner": "dask", "dask_workers": 2,
                              "dask_threads_per_worker": 2, "score_workers": 1}}
        started = time.monotonic()
        run = prefect("deployment", "run", "intern-bootcamp-datagen/intern-bootcamp-datagen-dask", "--watch",
                      "--params", json.dumps(params), env=env, cwd=work, timeout=300)
        worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:]
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:] + worker_log
    print(f"dask deployment run: {time.monotonic() - started:.1f} s")
    with get_client(sync_client=True) as client:  # this deployment's newest runs only: the server is the session's
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["intern-bootcamp-datagen-dask"])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=10)
        run_id = next(r.id for r in runs if (r.parameters.get("datagen") or {}).get("run_id") == "dask-trial")
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
    ejected = [log for log in logs if f"taking {sick} out of rotation" in log.message]
    assert ejected and all(log.level == 30 and log.task_run_id for log in ejected), [log.message for log in logs][-40:]
    # Each once: as many as the Dask workers logged (their output reaches the process worker's log).
    emitted = [line for line in (tmp_path / "worker.log").read_text(errors="replace").splitlines()
               if f"factory.inference.endpoints - taking {sick} out of rotation" in line]
    assert len(ejected) == len(emitted), (len(ejected), emitted)
    summary = assert_every_item_once(work / "data", "dask-trial", 12)
    assert summary["chunks_committed"] == 4
    # The chunks ran in the LocalCluster's worker processes, not in the flow's process.
    stats = [json.loads(p.read_text()) for p in (work / "data/dask-trial").glob("stats-intern-bootcamp-0*.json")]
    assert len({s["worker"]["pid"] for s in stats}) >= 1 and "No module named" not in worker_log


# ---- the README's SLURM trial, line by line -------------------------------------------------------------------------

STARTED_BY_FIXTURES = ("bash deployments/slurm/local_cluster.sh up", "factory-local up", "factory-policy-server")
"""README lines the test's fixtures stand in for: the one-node SLURM, the Prefect server, the policy server."""


def readme_trial_commands() -> list[str]:
    """The lines of the bash block under README's 'Try it on one machine', comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("**Try it on one machine**"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("\n```", start)]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def to_argv(line: str) -> tuple[list[str], bool]:
    """A README line as argv for this interpreter, and whether it ends in `&` (runs in the background)."""
    argv = shlex.split(line)
    background = argv[-1] == "&"
    argv = argv[:-1] if background else argv
    head = {"prefect": [sys.executable, "-m", "prefect"], "python": [sys.executable]}[argv[0]]
    return head + argv[1:], background


@pytest.mark.slurm
def test_the_readme_slurm_trial_runs_the_deployment_in_slurm_jobs(slurm, prefect_server, tmp_path):
    """README 'Try it on one machine': blocks saved, `prefect deploy`, a worker, `prefect deployment run` on SLURM."""
    from factory.inference.local_server import start_local_server
    from tests.integration.conftest import jobs_named

    lines = readme_trial_commands()
    fixture_lines, lines = lines[:len(STARTED_BY_FIXTURES)], lines[len(STARTED_BY_FIXTURES):]
    assert [line.startswith(head) for line, head in zip(fixture_lines, STARTED_BY_FIXTURES)] == [True] * 3, fixture_lines
    assert "--model models/starter-policy --port 30000" in fixture_lines[2]
    assert [line.split()[:3] for line in lines][-3:] == [["prefect", "--no-prompt", "deploy"],
                                                         ["prefect", "worker", "start"],
                                                         ["prefect", "deployment", "run"]], lines

    env, work = client_env(prefect_server), checkout_like(tmp_path)
    port = free_port()
    timings: dict[str, float] = {}
    with start_local_server(REPO / "models/starter-policy", port) as server, \
            watching_jobs("factory-datagen-slurm-trial") as seen:
        worker = None
        try:
            for line in lines:
                argv, background = to_argv(line.replace("127.0.0.1:30000", f"127.0.0.1:{port}"))
                if background:  # the work pool's worker
                    worker = process_worker("slurm-head", env=env, cwd=work, log=tmp_path / "worker.log", argv=argv)
                    worker.__enter__()
                    continue
                started = time.monotonic()
                done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
                timings[" ".join(line.split()[:3])] = round(time.monotonic() - started, 1)
                worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:] if worker else ""
                assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}{worker_log}"
            assert "Completed" in done.stdout, done.stdout[-3000:]
        finally:
            if worker is not None:
                worker.__exit__(None, None, None)
        assert server.base_url.endswith(str(port))
    print(f"README SLURM trial, seconds per command: {timings}")

    summary = assert_every_item_once(work / "data", "slurm-trial", 16)
    stats = [json.loads(p.read_text()) for p in (work / "data/slurm-trial").glob("stats-intern-bootcamp-0*.json")]
    jobs = {s["worker"]["slurm_job_id"] for s in stats}
    assert summary["chunks_committed"] == 4 and None not in jobs and jobs <= set(seen), (jobs, seen)
    # The run's own log names every job that ran a chunk, and its node, as its worker joined and left.
    log = run_logs()
    for job in jobs:
        assert f"worker joined: SLURM job {job} on node " in log, log[-3000:]
        assert f"worker left: SLURM job {job} on node " in log, log[-3000:]
    # A clean end: the workers exited by themselves, no job was cancelled, none is left.
    for job in seen:
        out = work / "logs" / f"slurm-{job}.out"
        assert not out.is_file() or "CANCELLED" not in out.read_text(), out.read_text()
    assert jobs_named("factory-datagen-slurm-trial") == []


@contextmanager
def watching_jobs(name: str) -> Iterator[dict[str, set[str]]]:
    from tests.integration.test_datagen_slurm import watch_queue

    with watch_queue(name) as seen:
        yield seen


def test_the_cli_samples_from_the_endpoints_block_like_the_deployment(prefect_server, tmp_path, capsys):
    """`--datagen.endpoints_block NAME`: preflight checks the block's endpoints, not the default openai.base_url."""
    from factory.inference.fault_server import FaultServer
    from flows.datagen import ENVIRONMENTS, run_datagen
    from flows.datagen_cli import main
    from flows.inference import register_endpoints

    with FaultServer() as server:
        register_endpoints.fn([server.base_url], "cli-test-endpoints")
        code = main(ENVIRONMENTS["intern_bootcamp"], [
            "process", "--config", str(REPO / "deployments/intern_bootcamp.yaml"),
            "--openai.base_url", "http://127.0.0.1:9",  # nothing listens here: the block's URL must win
            "--datagen.endpoints_block", "cli-test-endpoints", "--datagen.store_root", str(tmp_path / "data"),
            "--datagen.run_id", "cli-block", "--env.total_items", "4", "--env.group_size", "2",
            "--env.tokenizer_name", str(REPO / "models/starter-policy"), "--datagen.chunk_items", "2",
            "--datagen.score_mode", "inline"], run=run_datagen)
        assert code == 0, capsys.readouterr().err[-3000:]
        assert server.hits  # sampled from the block's server
    assert_every_item_once(tmp_path / "data", "cli-block", 4)
