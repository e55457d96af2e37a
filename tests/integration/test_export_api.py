"""`atropos-sft-gen --api-url` / `atropos-dpo-gen --api-url` against real HTTP servers speaking Atropos's protocol.

Two servers: a minimal FastAPI app started here that answers POST /register and
GET /batch exactly as Atropos's run-api does (including `{"batch": null}` while
it has nothing), and the factory's own `run-api` (factory/serve) following a
store run, when that package is present.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from factory.export.cli import main
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def _atropos_like_app(groups: list[dict], per_batch: int) -> FastAPI:
    app = FastAPI()
    state = {"registered": None, "queue": list(groups), "batches_served": 0}
    app.state.data = state

    @app.post("/register")
    async def register(body: dict) -> dict:
        state["registered"] = body
        return {"uuid": 1}

    @app.get("/batch")
    async def batch() -> dict:
        if state["registered"] is None:
            return {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
        if len(state["queue"]) < per_batch:
            return {"batch": None}
        out, state["queue"] = state["queue"][:per_batch], state["queue"][per_batch:]
        state["batches_served"] += 1
        return {"batch": out}

    return app


class _Server:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test API server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _wire_groups(count: int) -> list[dict]:
    return [json.loads(g.model_dump_json(include=set(g.wire_dict()))) for g in synthetic_groups(count, group_size=4)]


def test_sft_gen_reads_batches_until_the_row_limit(tmp_path):
    groups = _wire_groups(40)
    app = _atropos_like_app(groups, per_batch=8)
    with _Server(app) as url:
        out = tmp_path / "sft.jsonl"
        code = main("sft", [str(out), "--api-url", url, "--num-seqs-to-save", "30", "--group-size", "4",
                            "--tasks-per-step", "2", "--quiet"])
    assert code == 0
    assert app.state.data["registered"]["batch_size"] == 8  # group_size * tasks_per_step, as Atropos registers
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30
    expected = [
        (g["messages"][i], s) for g in groups
        for s, i in sorted(((s, i) for i, s in enumerate(g["scores"])), key=lambda p: -p[0])[:3] if s > 0
    ]
    assert [(r["messages"], r["score"]) for r in rows] == expected[:30]


def test_dpo_gen_stops_when_the_api_stays_empty(tmp_path):
    app = _atropos_like_app(_wire_groups(10), per_batch=4)  # 2 full batches, 2 groups never served
    with _Server(app) as url:
        out = tmp_path / "dpo"
        code = main("dpo", [str(out), "--api-url", url, "--num-seqs-to-save", "1000", "--api-idle-timeout", "1.5",
                            "--quiet"])
    assert code == 0
    assert app.state.data["batches_served"] == 2
    import datasets

    pairs = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert 0 < pairs.num_rows <= 8 * 3
    assert all(c - r > 0.5 for c, r in zip(pairs["score_chosen"], pairs["score_rejected"]))


def test_unreachable_api_is_reported(tmp_path, capsys):
    code = main("sft", [str(tmp_path / "o"), "--api-url", f"http://127.0.0.1:{free_port()}", "--quiet"])
    assert code == 1 and "cannot reach the batching API" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _factory_api(tmp_path: Path, name: str, *extra: str):
    """The factory's run-api following run-a of tmp_path/store, with its own served state `name` (an ApiProcess)."""
    pytest.importorskip("factory.serve.app", reason="factory/serve (run-api) is not in this checkout")
    from factory.serve.client import ApiProcess

    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--host", "127.0.0.1", "--port", str(port),
               "--store_root", str(tmp_path / "store"), "--follow_runs", "[run-a]", "--state_path",
               str(tmp_path / f"{name}.sqlite"), "--log_level", "warning", *extra]
    return ApiProcess(command, port, log_path=str(tmp_path / f"{name}.log"))


def _export(url: str, out: Path, *extra: str) -> list[dict]:
    code = main("sft", [str(out), "--api-url", url, "--group-size", "4", "--tasks-per-step", "4",
                        "--num-seqs-to-save", "1000", "--api-idle-timeout", "3", "--quiet", *extra])
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_sft_gen_against_the_factory_run_api(tmp_path):
    store = ShardStore(tmp_path / "store")
    store.commit("run-a", "w0", 0, list(synthetic_groups(24, group_size=4, run_id="run-a")))
    with _factory_api(tmp_path, "state") as api:
        rows = _export(api.url, tmp_path / "sft.jsonl")
    assert rows and all(r["score"] > 0 for r in rows)
    served_prompts = {r["messages"][0]["content"] for r in rows}
    assert len(served_prompts) >= 16  # at least 4 full batches of 4 groups came through


def test_arrow_batches_export_the_rows_json_batches_with_metadata_do(tmp_path):
    """The default CLI reads Arrow /batch bodies; --api-json reads JSON: the same rows (JSON lacks run_id, item_key)."""
    store = ShardStore(tmp_path / "store")
    groups = list(synthetic_groups(24, group_size=4, run_id="run-a"))
    groups[5].env = groups[9].env = "other"
    store.commit("run-a", "w0", 0, groups)
    with _factory_api(tmp_path, "arrow", "--batch_metadata", "true") as api:
        arrow_rows = _export(api.url, tmp_path / "arrow.jsonl")
    with _factory_api(tmp_path, "json", "--batch_metadata", "true") as api:
        json_rows = _export(api.url, tmp_path / "json.jsonl", "--api-json")
    with _factory_api(tmp_path, "filtered") as api:
        filtered = _export(api.url, tmp_path / "filtered.jsonl", "--env", "other")
    assert len(arrow_rows) == len(json_rows) > 40
    assert {(r["run_id"], bool(r["item_key"])) for r in arrow_rows} == {("run-a", True)}  # stored values: Arrow was read
    assert {(r["run_id"], r["item_key"]) for r in json_rows} == {("", "")}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("run_id", "item_key")} for r in rows]  # noqa: E731
    assert strip(arrow_rows) == strip(json_rows)
    assert {r["group_id"] for r in arrow_rows} <= {g.group_id for g in groups}
    assert {r["group_id"] for r in filtered} == {groups[5].group_id, groups[9].group_id}  # env names as stored
