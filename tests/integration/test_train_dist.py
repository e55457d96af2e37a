"""The distributed trainer under real torchrun (gloo, CPU): rank-count independence, resharded resume, weight push,
setup errors, and a killed rank.

Tolerance: 2 ranks vs 1 rank (and vs the single-process trainer) agree on every step's loss to 1e-5 relative and on
every weight to 1e-5 absolute after 4 AdamW steps at lr 1e-3; the only difference is float summation order
(the gradient is reduced over ranks in another order), measured at about 2e-7.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from factory.inference.local_server import start_local_server
from factory.inference.tiny_model import make_tiny_policy
from factory.store import ShardStore
from factory.train.config import TrainJobConfig
from factory.train.loop import run_training
from tests.unit.train.test_resume import _groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dist")
    policy = make_tiny_policy(base / "policy")
    store = ShardStore(base / "store")
    groups = _groups(40)
    for chunk in range(4):
        store.commit("toy", "p", chunk, groups[chunk * 10 : (chunk + 1) * 10])
    return {"base": base, "policy": policy, "store": base / "store"}


def _args(setup: dict[str, Path], out: Path, steps: int = STEPS) -> list[str]:
    return ["--source.kind", "store", "--source.store_root", str(setup["store"]), "--source.runs", "[toy]",
            "--train.model_path", str(setup["policy"]), "--train.output_dir", str(out), "--train.batch_size", "8",
            "--train.total_steps", str(steps), "--train.checkpoint_every", "2", "--train.threads", "1",
            "--train.optim.lr", "1e-3", "--train.optim.warmup_steps", "2", "--train.optim.micro_batch_size", "3"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _command(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "-m", "flows.train", *args]


def torchrun(n: int, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """Run a torchrun job to its end; on timeout the whole process group (launcher and ranks) is killed."""
    process = subprocess.Popen(_command(n, *args), env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"torchrun timed out after {timeout} s: {err[-2000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    directory = out / "weights" / f"step-{step:08d}"
    assert (directory / "WEIGHTS_READY").is_file()
    return load_file(str(directory / "model.safetensors"))


def _same_run(a: Path, b: Path) -> None:
    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    assert [r["batch"] for r in rb] == [r["batch"] for r in ra]
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def one_rank(setup: dict[str, Path]) -> Path:
    out = setup["base"] / "one-rank"
    _ok(torchrun(1, *_args(setup, out)))
    return out


@pytest.fixture(scope="module")
def two_ranks_at_step_2(setup: dict[str, Path]) -> Path:
    """A 2-rank run that "dies" right after its step-2 checkpoint (it was asked for 2 steps)."""
    out = setup["base"] / "two-ranks-cut"
    _ok(torchrun(2, *_args(setup, out, steps=2)))
    assert sorted(p.name for p in (out / "dcp").iterdir()) == ["step-00000002"]
    return out


def test_two_ranks_match_one_rank_and_resume_exactly(setup: dict[str, Path], one_rank: Path, two_ranks_at_step_2: Path):
    two = setup["base"] / "two-ranks"
    shutil.copytree(two_ranks_at_step_2, two)
    result = torchrun(2, *_args(setup, two))                            # resumed on the same rank count
    _ok(result)
    assert "resumed from" in result.stderr and "step-00000002" in result.stderr
    assert {r["world_size"] for r in _rows(two)} == {2}
    _same_run(one_rank, two)

    single = setup["base"] / "single-process"
    cfg = TrainJobConfig.model_validate({
        "train": {"model_path": str(setup["policy"]), "output_dir": str(single), "batch_size": 8, "total_steps": STEPS,
                  "checkpoint_every": 2, "threads": 1, "optim": {"lr": 1e-3, "warmup_steps": 2, "micro_batch_size": 3}},
        "source": {"kind": "store", "store_root": str(setup["store"]), "runs": ["toy"]},
    })
    run_training(cfg)
    for x, y in zip(_rows(single), _rows(two)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)


def test_resume_on_another_rank_count_and_push_to_the_policy_server(setup: dict[str, Path], one_rank: Path,
                                                                    two_ranks_at_step_2: Path):
    cut = setup["base"] / "two-then-one"
    shutil.copytree(two_ranks_at_step_2, cut)
    with start_local_server(setup["policy"]) as server:
        result = torchrun(1, *_args(setup, cut), "--push.endpoints", f"[{server.base_url}]")  # resharded 2 -> 1
        _ok(result)
        assert "resumed from" in result.stderr and "step-00000002" in result.stderr
        assert httpx.get(f"{server.base_url}/get_weight_version").json()["weight_version"] == str(STEPS)
        info = httpx.get(f"{server.base_url}/get_model_info").json()
        assert Path(info["model_path"]).resolve() == (cut / "weights" / f"step-{STEPS:08d}").resolve()
        prompt = [5, 17, 42, 99]
        body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
        meta = httpx.post(f"{server.base_url}/generate", json=body, timeout=60).json()["meta_info"]
    _same_run(one_rank, cut)
    from transformers import AutoModelForCausalLM

    served = [float(t[0]) for t in meta["output_token_logprobs"]]
    ids = [int(t[1]) for t in meta["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(one_rank / "weights" / f"step-{STEPS:08d}").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    assert served == pytest.approx(expected.tolist(), abs=1e-4)


def test_world_size_that_does_not_divide_the_batch_fails_with_one_line(setup: dict[str, Path], tmp_path: Path):
    result = torchrun(2, *_args(setup, tmp_path / "a"), "--train.batch_size", "7", timeout=90)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "train-grpo: error:" in line]
    assert lines == ["train-grpo: error: train.batch_size 7 is not divisible by the world size 2: use a batch size "
                     "that is a multiple of 2 or another --nproc-per-node"], result.stderr[-2000:]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_a_killed_rank_ends_every_rank(setup: dict[str, Path], tmp_path: Path):
    """Rank 0 waits on a batching API that is not there while rank 1 waits in the broadcast; SIGKILL rank 1."""
    command = _command(2, *_args(setup, tmp_path / "out"), "--source.kind", "api",
                       "--source.api_url", "http://127.0.0.1:9", "--source.max_wait_s", "600")
    launcher = subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        rank1 = None
        while rank1 is None and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()[-2000:]
            for child in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == "1" and "flows.train" in " ".join(child.cmdline()):
                        rank1 = child
                except psutil.Error:
                    continue
            time.sleep(0.5)
        assert rank1 is not None, "rank 1 did not start"
        ranks = [c for c in psutil.Process(launcher.pid).children(recursive=True) if c.pid != rank1.pid]
        time.sleep(8)                                                   # both ranks past model setup, in the loop
        killed = time.monotonic()
        os.kill(rank1.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        took = time.monotonic() - killed
        output = launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0 and took < 60, (took, output[-2000:])
    assert "Signals.SIGKILL" in output or "SIGKILL" in output or "exitcode" in output, output[-2000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks if _alive(p))


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running()
    except psutil.Error:
        return False


def test_dist_bench_smoke_prints_its_table(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "bench.train.dist", "--smoke", "--json-out", str(tmp_path / "b.jsonl")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 ranks | tokens/s/rank |" in done.stdout and "MFU not reported" in done.stdout
