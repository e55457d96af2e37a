"""The `atropos-env` flow runs an unchanged Atropos env (atroposlib 0.4.0's BaseEnv, in its own venv) against run-api.

The env below is written only against atroposlib: it samples a scripted OpenAI-compatible stand-in, scores
the answers, and posts its groups to run-api in `serve` mode. Its first process dies (exit 1) after two groups,
so the flow's retry must start it again. Checked: every group the env posted is in the store exactly once,
the flow stops at its target and completes, and its progress artifact reached 100.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

ENV_SCRIPT = '''
import os
import sys

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

CRASH_MARKER = {crash_marker!r}
WHERE = {where!r}


class DoublingEnv(BaseEnv):
    name = "doubling"

    @classmethod
    def config_init(cls):
        env = BaseEnvConfig(tokenizer_name={tokenizer!r}, group_size=2, use_wandb=False, total_steps=1000,
                            batch_size=8, max_token_length=256, max_batches_offpolicy=1000,
                            ensure_scores_are_not_same=False, max_num_workers=2, steps_per_eval=100000)
        return env, [APIServerConfig(model_name="stand-in", base_url="http://127.0.0.1:1/v1", api_key="x",
                                     health_check=False)]

    async def setup(self):
        with open(WHERE, "a") as where:  # which SLURM job (if any) this process runs in
            where.write(os.environ.get("SLURM_JOB_ID", "none") + "\\n")
        self.life = 0 if not os.path.exists(CRASH_MARKER) else 1
        self.next_item = 0
        self.posted = 0

    async def get_next_item(self):
        self.next_item += 1
        return (self.life, self.next_item)

    async def collect_trajectories(self, item):
        life, n = item
        question = f"life {{life}} item {{n}}: what is {{n}} + {{n}}?"
        reply = await self.server.chat_completion(messages=[{{"role": "user", "content": question}}],
                                                  n=self.config.group_size, max_tokens=8)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[], advantages=None, ref_logprobs=None,
                                group_overrides={{}}, overrides=None, images=None)
        for choice in reply.choices:
            answer = choice.message.content
            tokens = self.tokenizer.encode(question + " " + answer)
            group["tokens"].append(tokens)
            group["masks"].append([-100] * (len(tokens) - 1) + tokens[-1:])
            group["scores"].append(1.0 if answer.strip() == str(2 * n) else 0.0)
            group["messages"].append([{{"role": "user", "content": question}},
                                      {{"role": "assistant", "content": answer}}])
        return group, []

    async def handle_send_to_api(self, scored_data, item=None, do_send_to_api=True,
                                 abort_on_any_max_length_exceeded=True):
        await super().handle_send_to_api(scored_data, item, do_send_to_api, abort_on_any_max_length_exceeded)
        self.posted += 1
        if self.life == 0 and self.posted >= 2:  # the first process dies: the flow must start it again
            open(CRASH_MARKER, "w").close()
            os._exit(1)

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    DoublingEnv.cli()
'''


class _StandIn(BaseHTTPRequestHandler):
    """OpenAI chat completions: choice 0 answers the doubling right, the others wrong."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        n = int(body["messages"][-1]["content"].split("what is ")[1].split(" +")[0])
        choices = [{"index": i, "message": {"role": "assistant", "content": str(2 * n if i == 0 else 2 * n + i)},
                    "finish_reason": "stop"} for i in range(int(body.get("n", 1)))]
        data = json.dumps({"id": "x", "object": "chat.completion", "created": int(time.time()), "model": "stand-in",
                           "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def doubling_env_script(tmp_path: Path) -> Path:
    """ENV_SCRIPT written to tmp_path: its first process dies after two groups (marker file `crashed`), and every
    life appends its SLURM job id (or "none") to `where`."""
    script = tmp_path / "doubling_env.py"
    script.write_text(ENV_SCRIPT.format(tokenizer=str(REPO / "models" / "starter-policy"),
                                        crash_marker=str(tmp_path / "crashed"), where=str(tmp_path / "where")))
    return script


@pytest.fixture
def stand_in() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.fixture
def atropos_python() -> Path:
    from bench.atropos_venv import atropos_python as build

    try:
        return build()
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"cannot build the atroposlib venv (bench/atropos_venv.py; needs PyPI): {error}")


@pytest.fixture
def run_api(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port, store = free_port(), tmp_path / "store"
    log = open(tmp_path / "run-api.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "factory.serve.cli", "--host", "127.0.0.1", "--port", str(port),
                                "--store_root", str(store)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/status", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"run-api did not start: {(tmp_path / 'run-api.log').read_text()[-2000:]}")
        yield url, store
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_atropos_env_groups_land_once_through_a_crash_and_the_flow_completes(
        prefect_server, atropos_python, stand_in, run_api, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.atropos_env import atropos_env_flow

    api_url, store = run_api
    script = doubling_env_script(tmp_path)
    target = 5
    env = {"script": str(script), "python": str(atropos_python), "api_url": api_url, "inference_url": stand_in,
           "model_name": "stand-in", "env_name": "doubling", "target_groups": target, "max_runtime_s": 80,
           "max_restarts": 2, "poll_s": 0.3, "stop_grace_s": 5, "log_path": str(tmp_path / "env.log")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    state = atropos_env_flow(env=env, config_path=str(REPO / "deployments" / "atropos_env.yaml"), return_state=True)
    result = state.result()
    log = (tmp_path / "env.log").read_text(errors="replace")[-3000:]
    assert result["stopped_by"] == "target", log
    assert result["restarts"] == 1, log  # the first process died and Prefect's retry started a second
    assert result["groups"] >= target

    # Exactly once: every group the env posted is in the store once; none twice, none lost between the counter and
    # the shards.
    tables = [pq.read_table(path) for path in sorted((store / "api" / "shards").glob("*.parquet"))]
    questions = [json.loads(messages)[0][0]["content"] for table in tables
                 for env_name, messages in zip(table.column("env").to_pylist(), table.column("messages").to_pylist())
                 if env_name == "doubling"]
    assert len(questions) == result["groups"]
    assert not [q for q, count in Counter(questions).items() if count > 1]
    assert sum(q.startswith("life 0 ") for q in questions) == 2  # all the first process posted before it died
    assert any(q.startswith("life 1 ") for q in questions)
    scores = [s for table in tables for s in table.column("scores").to_pylist()]
    assert all(sorted(s) == [0.0, 1.0] for s in scores)  # the env's own scoring, stored as it posted it

    async def artifacts() -> tuple[float, str]:
        async with get_client() as client:
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

            found = await client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["atropos-env-progress", "atropos-env-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            by_key = {a.key: a for a in found}
            return float(by_key["atropos-env-progress"].data), str(by_key["atropos-env-summary"].data)

    import asyncio

    progress, summary = asyncio.run(artifacts())
    assert progress == 100.0
    assert f"{result['groups']} groups ingested" in summary
    assert (tmp_path / "where").read_text().split() == ["none", "none"]  # two lives, beside the flow


@pytest.mark.slurm
def test_atropos_env_process_runs_in_a_slurm_job(slurm, prefect_server, atropos_python, stand_in, run_api,
                                                  tmp_path):
    from blocks.slurm import SlurmClusterBlock
    from flows.atropos_env import atropos_env_flow

    api_url, store = run_api
    SlurmClusterBlock(job_name=f"factory-test-atropos-{os.getpid()}", cores=1, memory="2GB", walltime="00:10:00",
                      log_dir=str(tmp_path / "logs"), environment={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                      min_jobs=1, max_jobs=1).save("test-atropos-env", overwrite=True)
    script = doubling_env_script(tmp_path)
    env = {"script": str(script), "python": str(atropos_python), "api_url": api_url, "inference_url": stand_in,
           "model_name": "stand-in", "env_name": "doubling", "target_groups": 4, "max_runtime_s": 80,
           "max_restarts": 2, "poll_s": 0.3, "stop_grace_s": 5, "log_path": str(tmp_path / "env.log"),
           "args": ["--env.max_batches_offpolicy", "1000"]}
    result = atropos_env_flow(env=env, task_runner_block="factory-slurm-cluster/test-atropos-env")
    assert result["stopped_by"] == "target", (tmp_path / "env.log").read_text(errors="replace")[-3000:]
    assert result["restarts"] == 1
    jobs = (tmp_path / "where").read_text().split()
    assert len(jobs) == 2 and all(job.isdigit() for job in jobs), jobs  # both lives ran inside a SLURM job


def test_atropos_env_deployment_run_lands_the_envs_groups(prefect_server, atropos_python, stand_in, run_api,
                                                          tmp_path):
    """`prefect deploy --name atropos-env`, a process worker, a deployment run with the script and its venv given
    per run (as deployments/atropos_env.yaml says): the run completes at its target and the groups are stored."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from tests.integration.test_datagen_deployment import checkout_like, client_env, prefect, process_worker
    from tests.integration.test_deployments import wait_for

    api_url, store = run_api
    environ, work = client_env(prefect_server), checkout_like(tmp_path)
    deployed = prefect("--no-prompt", "deploy", "--name", "atropos-env", env=environ, cwd=work)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    shown = prefect("deployment", "inspect", "atropos-env/atropos-env", env=environ, cwd=work)
    assert "flows.atropos_env:atropos_env_flow" in shown.stdout and "deployments/atropos_env.yaml" in shown.stdout

    script = doubling_env_script(tmp_path)
    target = 3
    # Only what a user gives per run; the rest (args, restarts) merges in from the deployment's config file.
    env = {"script": str(script), "python": str(atropos_python), "api_url": api_url, "inference_url": stand_in,
           "model_name": "stand-in", "env_name": "doubling", "target_groups": target, "max_runtime_s": 80,
           "poll_s": 0.3, "stop_grace_s": 5, "log_path": str(tmp_path / "env.log")}
    with process_worker("local-process", env=environ, cwd=work, log=tmp_path / "worker.log"):
        run_id = run_deployment("atropos-env/atropos-env", parameters={"env": env}, timeout=0).id
        with get_client(sync_client=True) as client:
            run = wait_for(client, {"atropos-env": run_id}, timeout=240)["atropos-env"]
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    env_log = (tmp_path / "env.log").read_text(errors="replace")[-2000:] if (tmp_path / "env.log").exists() else ""
    assert run.state.is_completed(), (run.state, worker_log, env_log)
    tables = [pq.read_table(path) for path in sorted((store / "api" / "shards").glob("*.parquet"))]
    assert sum(env_name == "doubling" for table in tables for env_name in table.column("env").to_pylist()) >= target
