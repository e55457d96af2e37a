"""`atropos-sft-gen --api-url` / `atropos-dpo-gen --api-url` against real HTTP servers speaking Atropos's protocol.

Two servers: a minimal FastAPI app started here that answers POST /register and
GET /batch exactly as Atropos's run-api does (including `{"batch": null}` while
it has nothing), and the factory's own `run-api` (factory/serve) following a
store run, when that package is present.
"""

from __future__ import annotations

import json
import os
import subprocess
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


@pytest.fixture(autouse=True)
def _decode_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoders the CLIs save (factory/export/decode_cache.py) go to this test's tmp dir, not ~/.cache."""
    monkeypatch.setenv("FACTORY_DECODE_CACHE", str(tmp_path / "decoders"))


def _atropos_like_app(groups: list[dict], per_batch: int) -> FastAPI:
    app = FastAPI()
    state = {"registered": None, "queue": list(groups), "batches_served": 0}
    app.state.data = state

    @app.get("/reset_data")
    async def reset_data() -> str:
        state["resets"] = state.get("resets", 0) + 1
        return "Reset successful"

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
                            "--tasks-per-step", "2", "--save-messages", "--quiet"])
    assert code == 0 and app.state.data["resets"] == 1  # /reset_data, then /register, as Atropos's CLI
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
                            "--layout", "trl", "--quiet"])
    assert code == 0
    assert app.state.data["batches_served"] == 2
    import datasets

    pairs = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert 0 < pairs.num_rows <= 8 * 3
    assert all(c - r > 0.5 for c, r in zip(pairs["score_chosen"], pairs["score_rejected"]))


def test_unreachable_api_is_reported(tmp_path, capsys):
    code = main("sft", [str(tmp_path / "o"), "--api-url", f"http://127.0.0.1:{free_port()}", "--save-messages", "--quiet"])
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
                        "--num-seqs-to-save", "1000", "--api-idle-timeout", "3", "--layout", "trl", "--no-reset", "--quiet",
                        *extra])
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


# ---- side by side with atroposlib 0.4.0's own CLIs (its separate venv: python -m bench.atropos_venv) ----

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "starter-policy"


def _atropos_cli(name: str) -> Path:
    from bench.atropos_venv import DEFAULT_VENV, atropos_available

    if not atropos_available(DEFAULT_VENV):
        pytest.skip(f"atroposlib's venv is not built at {DEFAULT_VENV} (python -m bench.atropos_venv; ATROPOS_VENV "
                    "picks the place): the side-by-side comparison needs Atropos's own CLIs")
    return DEFAULT_VENV / "bin" / name


def _side_by_side_groups(count: int) -> list[dict]:
    """Groups of 4 with a shared prompt, distinct completions, ties, negatives and messages (token ids decode as text)."""
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode
    groups = []
    for i in range(count):
        prompt = encode(f"<|im_start|>user\nWhat is {i} + {i}? ü<|im_end|>\n<|im_start|>assistant\n").ids
        completions = [encode(f"{'The' if k % 2 else 'An'} answer is {2 * i + k - 1}.<|im_end|>").ids for k in range(4)]
        scores = [1.0, 0.25 * (i % 3), -0.5, 1.0 if i % 4 == 0 else 0.75 - 0.01 * i]
        groups.append({
            "tokens": [prompt + c for c in completions],
            "masks": [[-100] * len(prompt) + c for c in completions],
            "scores": scores,
            "messages": [[{"role": "user", "content": f"question {i} ü"}, {"role": "assistant", "content": f"answer {k}"}]
                         for k in range(4)],
        })
    return groups


def _run_against(api_url: str, command: list[str], out: Path, groups: list[dict], batch_size: int) -> list[str]:
    """Reset the API, start an export CLI, wait for its /register, post `groups`, wait for it to exit: its lines."""
    import httpx

    httpx.get(f"{api_url}/reset_data", timeout=10).raise_for_status()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{api_url}/info", timeout=10).json().get("batch_size") != batch_size:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{command[0]} did not register: {process.communicate(timeout=10)}")
            time.sleep(0.1)
        httpx.post(f"{api_url}/scored_data_list", json=groups, timeout=30).raise_for_status()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "output of register is" in stdout  # both print the /reset_data and /register answers
    return out.read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("kind, extra", [
    ("sft", ["--save-top-n-per-group", "2", "--tasks-per-step", "2"]),
    ("sft", ["--save-messages", "--tasks-per-step", "2", "--minimum-score-diff-max-min", "0.6"]),
    ("dpo", ["--save-n-pairs-per-group", "1"]),
    ("dpo", ["--save-n-pairs-per-group", "1", "--save-messages", "--allow-negative-scores"]),
])
def test_rows_are_atropos_rows_on_the_same_queued_data(tmp_path, kind, extra):
    """Both CLIs against one factory run-api, fed the same groups: our lines are Atropos's first lines, byte for byte.

    Text rows twice: decoded through transformers, then with the decoder that run saved (export/decode_cache.py).
    (DPO with one pair per group: Atropos draws the rejected with the unseeded global random, so only a single
    eligible rejected makes its output reproducible.)
    """
    theirs_cli = _atropos_cli(f"atropos-{kind}-gen")
    groups = _side_by_side_groups(16)
    limit = 15
    common = [*extra, "--group-size", "4", "--tokenizer", str(TOKENIZER), "--num-seqs-to-save", str(limit)]
    batch_size = 4 * (2 if kind == "sft" else 8)
    port = free_port()
    from factory.serve.client import ApiProcess

    api = ApiProcess([sys.executable, "-m", "factory.serve.cli", "--host", "127.0.0.1", "--port", str(port),
                      "--store_root", str(tmp_path / "store"), "--log_level", "warning"], port,
                     log_path=str(tmp_path / "api.log"))
    ours_cli = [sys.executable, "-c", f"from factory.export.cli import {kind}_main; {kind}_main()"]
    with api:
        theirs = _run_against(api.url, [str(theirs_cli), str(tmp_path / "theirs.jsonl"), "--api-url", api.url, *common],
                              tmp_path / "theirs.jsonl", groups, batch_size)
        ours = _run_against(api.url, [*ours_cli, str(tmp_path / "ours.jsonl"), "--api-url", api.url, *common],
                            tmp_path / "ours.jsonl", groups, batch_size)
        text = "--save-messages" not in extra
        if text:
            assert len(list((tmp_path / "decoders").glob("*.json"))) == 1
            again = _run_against(api.url, [*ours_cli, str(tmp_path / "again.jsonl"), "--api-url", api.url, *common],
                                 tmp_path / "again.jsonl", groups, batch_size)
    assert len(ours) == limit <= len(theirs)  # Atropos finishes the batch that crossed the limit
    assert ours == theirs[:limit]
    if text:
        assert again == ours


def test_a_tokenizer_that_does_not_load_ends_the_wait_for_batches(tmp_path, capsys):
    """The tokenizer loads in the background while the CLI registers and polls; its failure ends the run at once."""
    app = _atropos_like_app([], per_batch=8)  # never has a batch
    with _Server(app) as url:
        started = time.monotonic()
        code = main("sft", [str(tmp_path / "o.jsonl"), "--api-url", url, "--tokenizer", str(tmp_path / "missing"),
                            "--quiet"])
        seconds = time.monotonic() - started
    assert code == 1 and seconds < 20 and app.state.data["registered"] is not None
    err = capsys.readouterr().err.strip()
    assert err.startswith("atropos-sft-gen: cannot load tokenizer") and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())
