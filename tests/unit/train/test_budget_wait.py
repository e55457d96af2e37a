"""The trainer's wall-clock budget also bounds its wait for a batch.

An RL loop whose datagen has run out of items leaves the trainer asking an API that has nothing more to give: the
trainer must stop when its budget is spent (stop reason `max_runtime_s`), not wait out `max_wait_s` (600 s).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from factory.train.config import TrainJobConfig
from factory.train.loop import run_training
from factory.train.sources import ApiBatchSource, BudgetSpent, NoMoreBatches


class _EmptyApi(BaseHTTPRequestHandler):
    """An Atropos-protocol API whose queue stays empty (the fault under test: no more batches will come)."""

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json({"uuid": 1})

    def do_GET(self) -> None:  # noqa: N802
        self._json({"batch": None})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def empty_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmptyApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_wait_for_a_batch_ends_at_the_callers_deadline(empty_api: str) -> None:
    source = ApiBatchSource(empty_api, batch_size=1, max_token_len=8, num_steps=1, poll_s=0.05, max_wait_s=600)
    started = time.monotonic()
    with pytest.raises(BudgetSpent):
        source.next_batch(until=started + 0.5)
    assert 0.4 < time.monotonic() - started < 3.0
    source.close()


def test_max_wait_still_applies_when_it_comes_before_the_deadline(empty_api: str) -> None:
    source = ApiBatchSource(empty_api, batch_size=1, max_token_len=8, num_steps=1, poll_s=0.05, max_wait_s=0.3)
    with pytest.raises(NoMoreBatches) as caught:
        source.next_batch(until=time.monotonic() + 600)
    assert not isinstance(caught.value, BudgetSpent)
    source.close()


def test_a_trainer_with_no_batches_coming_stops_when_its_budget_is_spent(tiny_policy: Path, tmp_path: Path,
                                                                         empty_api: str) -> None:
    cfg = TrainJobConfig.model_validate({
        "train": {"model_path": str(tiny_policy), "output_dir": str(tmp_path / "out"), "batch_size": 8,
                  "total_steps": 100, "max_runtime_s": 1.5, "threads": 1},
        "source": {"kind": "api", "api_url": empty_api, "poll_s": 0.05, "max_wait_s": 600},
    })
    started = time.monotonic()
    summary = run_training(cfg)
    assert summary["stop_reason"] == "max_runtime_s" and summary["step"] == 0
    assert time.monotonic() - started < 60  # not max_wait_s (600 s)
