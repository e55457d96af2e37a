"""Resume is exact: a run cut between checkpoints and restarted ends where an unbroken run ends, batch for batch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from environments.groups import ScoredGroup
from factory.store import ShardStore
from factory.train.config import TrainJobConfig
from factory.train.loop import run_training
from factory.train.trainer import GRPOTrainer, latest_checkpoint


def _groups(n: int, group_size: int = 4, seed: int = 0) -> list[ScoredGroup]:
    rng = random.Random(seed)
    out = []
    for g in range(n):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 7))]
        tokens, masks, lps, scores = [], [], [], []
        for _ in range(group_size):
            completion = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 5))]
            tokens.append(prompt + completion)
            masks.append([-100] * len(prompt) + completion)
            lps.append([1.0] * len(prompt) + [-rng.uniform(4.0, 7.0) for _ in completion])
            scores.append(rng.choice([1.0, -0.5, 0.0]))
        scores[0] = 1.0 if scores[1] != 1.0 else -0.5
        out.append(ScoredGroup(tokens=tokens, masks=masks, scores=scores, inference_logprobs=lps,
                               env="toy", item_key=f"toy:{g}", group_id=f"g{g:04d}"))
    return out


@pytest.fixture
def store_run(tmp_path: Path) -> tuple[str, str]:
    store = ShardStore(tmp_path / "store")
    groups = _groups(40)
    for chunk in range(4):
        store.commit("toy", "p", chunk, groups[chunk * 10 : (chunk + 1) * 10])
    return str(tmp_path / "store"), "toy"


def _cfg(tiny_policy: Path, out: Path, store_run: tuple[str, str]) -> TrainJobConfig:
    root, run = store_run
    return TrainJobConfig.model_validate({
        "train": {"model_path": str(tiny_policy), "output_dir": str(out), "batch_size": 8, "total_steps": 6,
                  "checkpoint_every": 2, "keep_checkpoints": 5, "threads": 1,
                  "optim": {"lr": 1e-3, "warmup_steps": 2, "micro_batch_size": 3}},
        "source": {"kind": "store", "store_root": root, "runs": [run]},
    })


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_killed_between_checkpoints_resumes_exactly(tiny_policy: Path, tmp_path: Path, store_run):
    whole = _cfg(tiny_policy, tmp_path / "whole", store_run)
    assert run_training(whole)["step"] == 6
    cut = _cfg(tiny_policy, tmp_path / "cut", store_run)
    assert run_training(cut, stop_after_steps=3)["step"] == 3     # "crash" after step 3; last checkpoint is step 2
    assert latest_checkpoint(tmp_path / "cut").name == "step-00000002"
    summary = run_training(cut)
    assert summary["step"] == 6 and summary["session_steps"] == 4  # steps 3..6 again on the restored step-2 state

    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]            # step 3's line from the first session was cut
    assert [r["batch"] for r in b] == [r["batch"] for r in a]       # same batches, none twice, none lost
    assert len(set(r["batch"] for r in b)) == 6
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)

    wa = GRPOTrainer(whole.train)
    wa.restore(latest_checkpoint(tmp_path / "whole"))
    wb = GRPOTrainer(cut.train)
    wb.restore(latest_checkpoint(tmp_path / "cut"))
    for (name, pa), (_, pb) in zip(wa.model.named_parameters(), wb.model.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
    assert wa.step == wb.step == 6
    sa, sb = wa.optimizer.state_dict()["state"], wb.optimizer.state_dict()["state"]
    assert all(torch.allclose(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"], atol=1e-9) for k in sa)
    assert wa.scheduler.state_dict()["last_epoch"] == wb.scheduler.state_dict()["last_epoch"] == 6
    assert (tmp_path / "cut" / "reward_curve.png").is_file()


def test_checkpoint_is_a_hf_model_dir(tiny_policy: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TrainJobConfig.model_validate({"train": {"model_path": str(tiny_policy), "threads": 1}})
    trainer = GRPOTrainer(cfg.train)
    trainer.step = 7
    path = trainer.save(tmp_path / "ckpt")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    for (name, pa), (_, pb) in zip(trainer.model.named_parameters(), model.named_parameters()):
        assert torch.equal(pa, pb), name
    fresh = GRPOTrainer(cfg.train)
    fresh.restore(path)
    assert fresh.step == 7
