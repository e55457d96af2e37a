"""The RL loop with real processes: policy server -> groups -> batching API -> trainer -> weights pushed back.

Fast on purpose (a 0.1M-parameter policy, one-token answers): the task is "answer with a token from a fixed
set" (a quarter of the vocabulary), so the reward must rise within a few dozen steps. Also checks that the
server's logprobs after a push are the checkpoint's, and that a trainer killed with SIGKILL between
checkpoints and started again trains every batch exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from factory.inference.local_server import start_local_server
from factory.inference.tiny_model import make_tiny_policy
from factory.serve.client import ApiProcess, EnvClient
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from factory.train.config import TrainJobConfig
from factory.train.loop import run_training
from tests.conftest import free_port

pytestmark = pytest.mark.integration

GROUP = 8
BATCH = 32


def _api(tmp_path: Path, *extra: str) -> ApiProcess:
    """An API process for a `with` block, which starts it (starting it here too left a second one running)."""
    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(tmp_path / "store"), "--batch_metadata", "true", "--log_level", "warning", *extra]
    return ApiProcess(command, port, log_path=str(tmp_path / "api.log"))


def _produce(server: str, api: str, prompt: list[int], target: set[int], stop: threading.Event, errors: list[str]) -> None:
    """An environment: sample GROUP one-token answers per prompt, reward 1 for a target token, post to the API."""
    env = EnvClient(api, timeout=30)
    http = httpx.Client(timeout=60)
    try:
        env.register("fixed-token", group_size=GROUP, max_token_length=64)
        while not stop.is_set():
            if env.http.get("/status").json().get("queue_size", 0) >= 2 * BATCH // GROUP:
                time.sleep(0.05)
                continue
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"n": GROUP, "max_new_tokens": 1, "temperature": 1.0}}
            outs = http.post(f"{server}/generate", json=body).json()
            outs = outs if isinstance(outs, list) else [outs]
            tokens, masks, lps, scores, version = [], [], [], [], None
            for out in outs:
                meta = out["meta_info"]
                ids = [int(t[1]) for t in meta["output_token_logprobs"]]
                tokens.append(prompt + ids)
                masks.append([-100] * len(prompt) + ids)
                lps.append([1.0] * len(prompt) + [float(t[0]) for t in meta["output_token_logprobs"]])
                scores.append(1.0 if ids[0] in target else 0.0)
                version = int(meta.get("weight_version", 0))
            if len(set(scores)) == 1:
                continue
            env.post([{"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": lps,
                       "policy_version": version}])
    except Exception as error:  # noqa: BLE001 - reported by the test
        if not stop.is_set():
            errors.append(repr(error))


def test_reward_rises_and_server_serves_the_checkpoint(tmp_path: Path):
    policy = make_tiny_policy(tmp_path / "policy")
    vocab = 300
    target = set(range(0, vocab, 4))
    prompt = [5, 17, 42, 7]
    with start_local_server(policy) as server, _api(tmp_path) as api:
        cfg = TrainJobConfig.model_validate({
            "train": {"model_path": str(policy), "output_dir": str(tmp_path / "ckpt"), "batch_size": BATCH,
                      "total_steps": 30, "checkpoint_every": 2, "threads": 1,
                      "optim": {"lr": 3e-3, "micro_batch_size": BATCH}},
            "source": {"kind": "api", "api_url": api.url, "poll_s": 0.05, "max_wait_s": 60},
            "push": {"endpoints": [server.base_url]},
        })
        stop, errors = threading.Event(), []
        producer = threading.Thread(target=_produce, args=(server.base_url, api.url, prompt, target, stop, errors), daemon=True)
        producer.start()
        try:
            summary = run_training(cfg)
        finally:
            stop.set()
            producer.join(timeout=30)
        assert not errors, errors
        rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
        first, last = rows[:5], rows[-5:]
        before = sum(r["reward_mean"] for r in first) / 5
        after = sum(r["reward_mean"] for r in last) / 5
        assert after > before + 0.25, [round(r["reward_mean"], 2) for r in rows]
        assert all(r["policy_lag"] is not None and r["policy_lag"] <= 4 for r in rows)

        # The server now serves the final checkpoint as version = step; its logprobs are the checkpoint's.
        assert httpx.get(f"{server.base_url}/get_weight_version").json()["weight_version"] == "30"
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        meta = httpx.post(f"{server.base_url}/generate", json=body, timeout=60).json()["meta_info"]
        served = [float(t[0]) for t in meta["output_token_logprobs"]]
        ids = [int(t[1]) for t in meta["output_token_logprobs"]]
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"]).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
        assert served == pytest.approx(expected.tolist(), abs=1e-4)
    assert Path(summary["curve"]).is_file()


def _wait_for_step(metrics: Path, step: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"trainer exited early with {process.returncode}"
        if metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"trainer did not reach step {step}")


def test_sigkilled_trainer_resumes_without_losing_or_repeating_batches(tmp_path: Path):
    policy = make_tiny_policy(tmp_path / "policy")
    ShardStore(tmp_path / "store").commit("gen", "p", 0, synthetic_groups(48, group_size=4, seq_len=12, vocab=250, seed=5))
    out = tmp_path / "ckpt"
    with _api(tmp_path, "--follow_runs", "[gen]", "--follow_interval_s", "0.1") as api:
        args = [sys.executable, "-m", "factory.train.loop", "--train.model_path", str(policy),
                "--train.output_dir", str(out), "--train.batch_size", "16", "--train.total_steps", "8",
                "--train.checkpoint_every", "2", "--train.threads", "1", "--source.api_url", api.url,
                "--source.poll_s", "0.05", "--source.max_wait_s", "60"]
        env_vars = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / "trainer.log", "ab")
        first = subprocess.Popen(args, env=env_vars, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_step(out / "metrics.jsonl", 3, first)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        before = {json.loads(line)["step"]: json.loads(line)["batch"] for line in (out / "metrics.jsonl").read_text().splitlines()}
        second = subprocess.run(args, env=env_vars, stdout=log, stderr=subprocess.STDOUT, timeout=300)
        assert second.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    batches = [r["batch"] for r in rows]
    assert len(set(batches)) == 8                                   # nothing trained twice in the final model
    for step, batch in before.items():                             # steps redone after the kill got the same batch
        assert batches[step - 1] == batch
    assert (out / "checkpoints" / "step-00000008").is_dir()


def test_train_grpo_flow_offline_from_shards(prefect_server, tmp_path: Path):
    """The Prefect flow on a run's shards (source.kind=store): checkpoints, metrics, curve and artifacts."""
    from prefect.client.orchestration import get_client

    from flows.train import train_grpo

    policy = make_tiny_policy(tmp_path / "policy")
    ShardStore(tmp_path / "store").commit("gen", "p", 0, synthetic_groups(20, group_size=4, seq_len=12, vocab=250))
    summary = train_grpo(
        train={"model_path": str(policy), "output_dir": str(tmp_path / "out"), "batch_size": 16, "total_steps": 4,
               "checkpoint_every": 2, "threads": 1},
        source={"kind": "store", "store_root": str(tmp_path / "store"), "runs": ["gen"]},
    )
    assert summary["step"] == 4 and summary["stop_reason"] == "total_steps"
    assert (tmp_path / "out" / "checkpoints" / "step-00000004" / "model.safetensors").is_file()
    assert Path(summary["curve"]).is_file()

    async def artifact_keys() -> set[str]:
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    keys = asyncio.run(artifact_keys())
    assert {"train-grpo-summary", "train-grpo-summary-steps"} <= keys
