"""The env script's `evaluate` and `serve` modes end to end: the starter policy on the local CPU server, a real
Prefect server and, for `serve`, the real batching API (`run-api`) with a trainer pulling batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from factory.store import ShardStore
from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STARTER = REPO / "models" / "starter-policy"
SCRIPT = [sys.executable, "environments/intern_bootcamp.py"]


@pytest.fixture(scope="module")
def policy_url():
    from factory.inference.local_server import start_local_server

    with start_local_server(STARTER) as handle:
        yield handle.base_url


def script_env(prefect_server: dict[str, str]) -> dict[str, str]:
    """The script's sys.path starts at environments/: point it at this checkout, not a pip-installed copy."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **prefect_server, "PYTHONPATH": os.pathsep.join(paths)}


def common_args(policy_url: str, tmp_path: Path) -> list[str]:
    return ["--openai.base_url", policy_url, "--openai.model_name", "starter-policy",
            "--env.tokenizer_name", str(STARTER), "--env.max_tokens", "24",
            "--datagen.store_root", str(tmp_path / "data")]


def test_evaluate_writes_metrics_and_samples_per_family(prefect_server, policy_url, tmp_path):
    out = tmp_path / "eval"
    run = subprocess.run([*SCRIPT, "evaluate", *common_args(policy_url, tmp_path), "--env.eval_items", "42",
                          "--datagen.output_dir", str(out)], check=False, cwd=REPO, env=script_env(prefect_server),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]

    assert len(samples) == metrics["items"] == 42
    assert len({s["item_key"] for s in samples}) == 42
    assert metrics["accuracy"] == pytest.approx(sum(s["correct"] for s in samples) / 42)
    assert metrics["mean_score"] == pytest.approx(sum(s["score"] for s in samples) / 42)
    by_family: dict[str, list[bool]] = {}
    for sample in samples:
        by_family.setdefault(sample["answer"]["family"], []).append(sample["correct"])
        assert sample["messages"][-1]["role"] == "user" and isinstance(sample["completion"], str)
        assert sample["score"] == 1.0 if sample["correct"] else sample["score"] < 1.0
    assert len(by_family) >= 10  # the RandomTask mix reaches most families
    for family, correct in by_family.items():
        assert metrics[f"accuracy/{family}"] == pytest.approx(sum(correct) / len(correct))
    # Greedy answers of the warm-started policy are tagged and often right (it was trained on these families).
    assert metrics["accuracy"] > 0.1
    assert sum("<answer>" in s["completion"] for s in samples) >= 21
    # Eval items are not the training items a datagen run with the same config works through.
    from environments.intern_bootcamp import InternBootcampEnv

    training = {InternBootcampEnv().get_item(i).key for i in range(1000)}
    assert not training & {s["item_key"] for s in samples}


def test_serve_pauses_while_the_trainer_is_behind_and_finishes_after_it_pulls(prefect_server, policy_url, tmp_path):
    from factory.serve.client import ApiProcess, TrainerClient

    store = ShardStore(tmp_path / "data")
    port = free_port()
    api = ApiProcess([sys.executable, "-m", "factory.serve.cli", "--host", "127.0.0.1", "--port", str(port),
                      "--store_root", str(tmp_path / "data"), "--follow_runs", "[serve-run]",
                      "--follow_interval_s", "0.2", "--log_level", "warning"], port,
                     log_path=str(tmp_path / "api.log"))
    group_size, batch_size, chunk_items, total_items = 4, 8, 2, 8
    limit_groups = batch_size // group_size  # max_batches_offpolicy 1: one batch of 2 groups = one chunk
    with api:
        trainer = TrainerClient(api.url)
        trainer.register(batch_size)
        log_path = tmp_path / "flow.log"
        with open(log_path, "wb") as log:
            flow = subprocess.Popen(
                [*SCRIPT, "serve", *common_args(policy_url, tmp_path), "--serve.api_url", api.url,
                 "--serve.max_batches_offpolicy", "1", "--serve.poll_s", "0.2",
                 "--env.group_size", str(group_size), "--env.total_items", str(total_items),
                 "--env.ensure_scores_are_not_same", "false", "--datagen.run_id", "serve-run",
                 "--datagen.chunk_items", str(chunk_items), "--datagen.chunks_in_flight", "2"],
                cwd=REPO, env=script_env(prefect_server), stdout=log, stderr=subprocess.STDOUT)
        try:
            # The first chunk fills the allowed queue: the flow pauses and produces nothing more.
            deadline = time.monotonic() + 120
            while "paused: the trainer" not in log_path.read_text(errors="replace"):
                assert flow.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(3)
            assert flow.poll() is None
            assert len(store.committed("serve-run")) == 1, "the flow ran ahead of the trainer"

            served: Counter[str] = Counter()
            batches = 0
            while flow.poll() is None or batches < total_items // limit_groups:
                assert time.monotonic() < deadline + 120, log_path.read_text()[-3000:]
                committed_groups = store.count("serve-run")
                # Never more than max_batches_offpolicy batches ahead of what the trainer took.
                assert committed_groups - sum(served.values()) <= limit_groups
                batch = trainer.batch()
                if batch is None:
                    time.sleep(0.1)
                    continue
                batches += 1
                assert sum(len(group["tokens"]) for group in batch) == batch_size
                for group in batch:
                    served[json.dumps(group["tokens"])] += 1
        finally:
            if flow.poll() is None:
                flow.kill()
            flow.wait()
    output = log_path.read_text(errors="replace")
    assert flow.returncode == 0, output[-3000:]
    assert "resumed after" in output
    start = output.rindex("\n{\n") + 1  # serve prints the summary as indented JSON
    summary = json.loads(output[start:output.index("\n}", start) + 2])
    assert summary["chunks_committed"] == total_items // chunk_items and summary["groups_kept"] == total_items
    assert summary["paused_s"] > 1.0
    assert batches == total_items // limit_groups and len(served) == total_items  # every group once
    assert store.verify("serve-run") == []


def test_process_writes_groups_html_with_the_viewer_templates_and_view_run_links_the_flow_run(
        prefect_server, policy_url, tmp_path):
    from starlette.testclient import TestClient

    from factory.viewer.app import ViewerConfig, create_app

    out = tmp_path / "out"
    run = subprocess.run([*SCRIPT, "process", *common_args(policy_url, tmp_path), "--env.total_items", "8",
                          "--env.group_size", "4", "--env.ensure_scores_are_not_same", "false",
                          "--datagen.chunk_items", "4", "--datagen.run_id", "proc", "--datagen.output_dir", str(out)],
                         check=False, cwd=REPO, env=script_env(prefect_server), capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    page = (out / "groups.html").read_text()
    assert page.count('<details class="group">') == 8 and page.count('class="completion"') == 32  # shared macros
    assert "<style>" in page and "<script" not in page

    client = TestClient(create_app(ViewerConfig(store=str(tmp_path / "data"), prefect_ui="http://ui.test")))
    run_page = client.get("/run/proc").text
    assert 'data-groups="8"' in run_page and "intern_bootcamp" in run_page
    assert 'href="http://ui.test/runs/flow-run/' in run_page and "2 chunks" in run_page
