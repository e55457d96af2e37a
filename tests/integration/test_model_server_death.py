"""A model server that dies mid-run is noticed within seconds: the run goes on on the other endpoints, or fails with
one line naming the dead ones when none is left (before: RUNNING and silent for 12+ minutes). Ctrl-C ends the run
Cancelled with one line and no KeyboardInterrupt traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.inference.fault_server import FaultServer
from factory.store import ShardStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "environments/intern_bootcamp.py", "process"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    from factory.inference.tiny_model import make_tiny_policy

    return str(make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny"))


def script_env(prefect: dict[str, str]) -> dict[str, str]:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **prefect, "PYTHONPATH": os.pathsep.join(paths)}


def start_run(prefect, tokenizer: str, urls: list[str], store: Path, run_id: str, items: int) -> subprocess.Popen:
    args = ["--openai.base_url", json.dumps(urls) if len(urls) > 1 else urls[0], "--env.tokenizer_name", tokenizer,
            "--env.group_size", "4", "--env.max_tokens", "8", "--env.ensure_scores_are_not_same", "false",
            "--env.total_items", str(items), "--datagen.store_root", str(store), "--datagen.run_id", run_id,
            "--datagen.chunk_items", "4", "--datagen.score_workers", "1", "--datagen.chunks_in_flight", "1",
            "--openai.health_interval_s", "2"]
    return subprocess.Popen([*SCRIPT, *args], cwd=REPO, env=script_env(prefect), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_commits(process: subprocess.Popen, store: ShardStore, run_id: str, count: int) -> None:
    deadline = time.monotonic() + 240
    while len(store.committed(run_id)) < count:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def pipeline_run(run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"intern-bootcamp-{run_id}"])))
    return run  # the CLI runs the pipeline flow at top level


def test_the_only_model_server_dying_fails_the_run_within_seconds_naming_it(prefect_server, tokenizer, tmp_path):
    server = FaultServer(delay_s=0.2).start()
    process = start_run(prefect_server, tokenizer, [server.base_url], tmp_path, "dies", 400)
    store = ShardStore(tmp_path)
    try:
        wait_for_commits(process, store, "dies", 1)
        server.stop()
        killed = time.monotonic()
        out, err = process.communicate(timeout=180)
        took = time.monotonic() - killed
    finally:
        server.stop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    print(f"model server killed -> run exited in {took:.1f}s")
    assert process.returncode == 1, err[-3000:]
    assert last_line(err).startswith(f"error: every inference endpoint is down: {server.base_url} failing for"), err[-3000:]
    assert took < 45, took  # 15 s openai.down_after_s + a health-check interval + a loaded machine
    assert store.verify("dies") == [] and 1 <= len(store.committed("dies")) < 100
    run = pipeline_run("dies")
    assert run.state.is_failed() and run.run_count == 1
    assert "every inference endpoint is down" in run.state.message


def test_one_of_two_model_servers_dying_is_routed_around(prefect_server, tokenizer, tmp_path):
    survivor, doomed = FaultServer(delay_s=0.05).start(), FaultServer(delay_s=0.05).start()
    process = start_run(prefect_server, tokenizer, [survivor.base_url, doomed.base_url], tmp_path, "half", 80)
    store = ShardStore(tmp_path)
    try:
        wait_for_commits(process, store, "half", 1)
        doomed.stop()
        out, err = process.communicate(timeout=240)
    finally:
        survivor.stop()
        doomed.stop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err[-3000:]
    assert len(store.committed("half")) == 20 and store.verify("half") == []
    assert f"taking {doomed.base_url} out of rotation" in out + err
    run = pipeline_run("half")
    assert run.state.is_completed()


def test_ctrl_c_ends_the_run_cancelled_with_one_line_and_no_traceback(prefect_server, tokenizer, tmp_path):
    server = FaultServer(delay_s=0.2).start()
    process = start_run(prefect_server, tokenizer, [server.base_url], tmp_path, "ctrlc", 400)
    store = ShardStore(tmp_path)
    try:
        wait_for_commits(process, store, "ctrlc", 1)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = process.communicate(timeout=90)
    finally:
        server.stop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, err[-3000:]
    assert last_line(err).startswith("error: stopped by SIGINT"), err[-3000:]
    assert "KeyboardInterrupt" not in out + err and "Traceback" not in out + err, err[-5000:]
    assert pipeline_run("ctrlc").state.is_cancelled()
