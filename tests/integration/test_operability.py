"""Operability with real processes: preflight fails in seconds with the cause last, SIGTERM stops within the grace
period with nothing partial committed and the run Cancelled, and a kill -9'd run is marked Crashed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.store import ShardStore
from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "environments/intern_bootcamp.py"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy

    model = make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")
    with start_local_server(model) as handle:
        yield handle.base_url, str(model)


def script_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **(extra or {}), "PYTHONPATH": os.pathsep.join(paths)}


def args(base_url: str, tokenizer: str, store: Path, run_id: str, *extra: str) -> list[str]:
    return ["--openai.base_url", base_url, "--env.tokenizer_name", tokenizer, "--env.group_size", "4",
            "--env.max_tokens", "8", "--env.ensure_scores_are_not_same", "false", "--datagen.store_root", str(store),
            "--datagen.run_id", run_id, "--datagen.chunk_items", "4", "--datagen.score_workers", "1", *extra]


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def flow_runs(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))


def test_unreachable_url_and_missing_tokenizer_fail_in_seconds_with_the_cause_last(policy, tmp_path):
    _, tokenizer = policy
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    run = subprocess.run([*SCRIPT, "process", *args(dead, tokenizer, tmp_path, "r")], cwd=REPO, env=script_env(),
                         capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert run.returncode == 2, run.stderr[-2000:]
    assert last_line(run.stderr).startswith(f"error: preflight: openai.base_url='{dead}': not reachable")
    assert elapsed < 30, elapsed  # mostly interpreter start; before: ~30 minutes of retries

    missing = str(tmp_path / "no-such-policy")
    run = subprocess.run([*SCRIPT, "process", *args(dead, missing, tmp_path, "r")], cwd=REPO, env=script_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert last_line(run.stderr).startswith(f"error: preflight: env.tokenizer_name='{missing}': no such directory")


def test_flow_preflight_failure_is_failed_at_once_not_retried(prefect_server, policy, tmp_path):
    _, tokenizer = policy
    dead = f"http://127.0.0.1:{free_port()}"
    job = {"env": {"tokenizer_name": tokenizer, "total_items": 4}, "openai": {"base_url": dead},
           "datagen": {"store_root": str(tmp_path), "run_id": "pre"}}
    script = ("import json, sys; from flows.datagen import intern_bootcamp_datagen; "
              "intern_bootcamp_datagen(**json.loads(sys.argv[1]))")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script, json.dumps(job)], cwd=REPO, env=script_env(prefect_server),
                         capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert run.returncode != 0
    assert "PreflightError: preflight: openai.base_url=" in last_line(run.stderr), run.stderr[-3000:]
    assert elapsed < 45, elapsed  # the flow's retries (2 x 30 s) are skipped for a wrong setting
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    # Newest first: the session's server holds every earlier test's runs (the API's default page is 200).
    with get_client(sync_client=True) as client:
        recent = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=50)
        (flow_run,) = [r for r in recent if r.parameters.get("datagen", {}).get("run_id") == "pre"]
    assert flow_run.state.is_failed() and flow_run.run_count == 1
    assert "PreflightError: preflight: openai.base_url=" in flow_run.state.message


def test_sigterm_commits_what_finishes_in_grace_marks_the_run_cancelled_and_exits(prefect_server, policy, tmp_path):
    base_url, tokenizer = policy
    process = subprocess.Popen(
        [*SCRIPT, "process", *args(base_url, tokenizer, tmp_path, "term", "--env.total_items", "400",
                                   "--env.max_tokens", "24", "--datagen.chunks_in_flight", "2",
                                   "--datagen.shutdown_grace_s", "5")],
        cwd=REPO, env=script_env(prefect_server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = ShardStore(tmp_path)
    deadline = time.monotonic() + 240
    while len(store.committed("term")) < 1:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert "progress: intern-bootcamp: 1/100 chunks, " in out + err  # the terminal progress line
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 5 + 3 + 10, took  # grace + watchdog margin + a loaded machine; before: ran to the end (~10 min)
    assert last_line(err).startswith("error: stopped by SIGTERM"), err[-2000:]
    committed = len(store.committed("term"))
    assert 1 <= committed < 100 and store.verify("term") == []
    assert not list(store.shards_dir("term").glob(".*"))  # no partial shard left behind
    (run,) = flow_runs("intern-bootcamp-term")
    assert run.state.is_cancelled(), run.state
    assert run.state.message.startswith("stopped by SIGTERM")


def test_kill_9_run_is_marked_crashed_by_the_next_start(prefect_server, policy, tmp_path):
    base_url, tokenizer = policy
    process = subprocess.Popen(
        [*SCRIPT, "process", *args(base_url, tokenizer, tmp_path, "zombie", "--env.total_items", "400",
                                   "--env.max_tokens", "24")],
        cwd=REPO, env=script_env(prefect_server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    store = ShardStore(tmp_path)
    deadline = time.monotonic() + 240
    while len(store.committed("zombie")) < 1:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    (killed,) = flow_runs("intern-bootcamp-zombie")
    assert killed.state.is_running()  # what Prefect alone leaves behind

    rerun = subprocess.run([*SCRIPT, "process", *args(base_url, tokenizer, tmp_path, "zombie", "--env.total_items", "8")],
                           cwd=REPO, env=script_env(prefect_server), capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    states = {run.id: run.state for run in flow_runs("intern-bootcamp-zombie")}
    assert states[killed.id].is_crashed(), states[killed.id]
    assert "died" in states[killed.id].message
    assert sum(1 for state in states.values() if state.is_completed()) == 1


def test_local_stack_installs_the_zombie_automation_and_heartbeats(prefect_server):
    from prefect.automations import Automation

    from factory.local_prefect import ZOMBIE_AUTOMATION

    automation = Automation.read(name=ZOMBIE_AUTOMATION)
    assert automation.enabled and automation.actions[0].state.value == "CRASHED"
    assert prefect_server["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


def test_artifacts_land_on_the_run_the_user_started(prefect_server, policy, tmp_path):
    from prefect.artifacts import Artifact

    from flows.datagen import intern_bootcamp_datagen

    base_url, tokenizer = policy
    state = intern_bootcamp_datagen(
        env={"group_size": 2, "total_items": 2, "max_tokens": 4, "tokenizer_name": tokenizer,
             "ensure_scores_are_not_same": False},
        openai={"base_url": base_url}, datagen={"store_root": str(tmp_path), "run_id": "art", "chunk_items": 2,
                                                "score_workers": 1},
        return_state=True)
    assert state.is_completed()
    parent = state.state_details.flow_run_id
    for key in ("art-progress", "art-summary"):
        artifact = Artifact.get(key)
        assert artifact is not None and artifact.flow_run_id == parent, key
    assert "file://" in Artifact.get("art-summary").description

    import io

    from prefect.logging.handlers import APILogWorker

    from factory.progress import watch

    APILogWorker.drain_all(timeout=10)
    out = io.StringIO()
    assert watch(str(parent), poll_s=0.2, stream=out) == 0
    lines = out.getvalue().splitlines()
    assert any(line.startswith("progress: intern-bootcamp: 1/1 chunks") for line in lines), lines
    assert lines[-1].endswith(": Completed")
