"""The distributed trainer's pieces in one process (a gloo group of one rank): batch split, LoRA step, merged export."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from factory.train.batch import TrainSequence, token_weights
from factory.train.config import TrainSettings
from factory.train.dist_trainer import DistGRPOTrainer, WorldSizeError, check_world, micro_batch_count, rank_share
from factory.train.sharding import ModelLoadError, build_policy, load_causal_lm
from factory.train.world import World
from tests.conftest import free_port


def _seq(n: int, trained: int) -> TrainSequence:
    return TrainSequence(list(range(n)), list(range(1, n + 1)), [i >= n - trained for i in range(n)], [1.0] * n,
                         [-1.0] * n, None, 1.0)


def test_world_size_must_divide_the_batch():
    check_world(8, 2)
    with pytest.raises(WorldSizeError, match="train.batch_size 7 is not divisible by the world size 2"):
        check_world(7, 2)


def test_rank_shares_cover_the_batch_once_with_step_weights():
    seqs = [_seq(n, t) for n, t in [(5, 2), (9, 4), (3, 1), (7, 7), (4, 2)]]
    weights = token_weights(seqs, "token_mean")
    shares = [rank_share(seqs, weights, r, 2) for r in range(2)]
    ids = sorted(id(s) for share, _ in shares for s in share)
    assert ids == sorted(id(s) for s in seqs)
    assert [len(s.inputs) for s in shares[0][0]] == [9, 5, 3] and [len(s.inputs) for s in shares[1][0]] == [7, 4]
    assert sum(w * s.trained_tokens for share, ws in shares for s, w in zip(share, ws)) == pytest.approx(1.0)
    assert micro_batch_count(5, 2, 2) == 2 and micro_batch_count(1, 4, 8) == 1


def test_model_dir_that_does_not_load_is_one_clear_error(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_causal_lm(str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="does not load: its config.json"):
        load_causal_lm(str(tmp_path / "bad"))


def _rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)


def test_a_rank_with_a_model_dir_that_does_not_load_prints_one_line(monkeypatch, tmp_path: Path, capsys):
    from factory.train.dist_loop import main_distributed

    _rank_env(monkeypatch)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    code = main_distributed(["--train.model_path", str(bad), "--train.output_dir", str(tmp_path / "out"),
                             "--source.kind", "store", "--source.runs", "[x]"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "[rank 0]" not in line]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"train-grpo: error: train.model_path {str(bad)!r}") and "does not load" in err[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):
    """A real gloo process group of one rank in this process (what torchrun --nproc-per-node 1 sets up)."""
    _rank_env(monkeypatch)
    world = World.from_env("cpu").init("gloo", 60)
    yield world
    world.shutdown()


def _groups(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        prompt = [rng.randrange(3, 200) for _ in range(5)]
        tokens, masks, lps = [], [], []
        for _ in range(4):
            completion = [rng.randrange(3, 200) for _ in range(3)]
            tokens.append(prompt + completion)
            masks.append([-100] * 5 + completion)
            lps.append([0.0] * 5 + [-5.0] * 3)
        out.append({"tokens": tokens, "masks": masks, "scores": [1.0, 0.0, 0.5, 0.0], "inference_logprobs": lps})
    return out


def test_lora_step_changes_only_adapters_and_merged_export_matches(one_rank: World, tiny_policy: Path, tmp_path: Path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.train.weights import MARKER, export_weights

    cfg = TrainSettings.model_validate({"model_path": str(tiny_policy), "output_dir": str(tmp_path / "out"),
                                        "batch_size": 8, "lora": {"enabled": True, "r": 4, "alpha": 8},
                                        "optim": {"lr": 1e-2, "micro_batch_size": 3}})
    torch.manual_seed(0)
    model = build_policy(cfg, one_rank)
    trainer = DistGRPOTrainer(cfg, one_rank, model, AutoTokenizer.from_pretrained(tiny_policy))
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train_step(_groups())
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_B" in n for n in changed)           # B starts at zero, so A's first gradient is zero
    assert not any(torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)

    path = export_weights(model, trainer.tokenizer, cfg, 1, one_rank)
    assert (path / MARKER).is_file()
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([_groups()[0]["tokens"][0]])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    base = load_file(str(tiny_policy / "model.safetensors"))
    exported = load_file(str(path / "model.safetensors"))
    assert set(exported) == set(base)                                 # plain HF names, adapters merged away
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(exported["model.norm.weight"], base["model.norm.weight"])

    cfg.lora.push = "adapter"
    adapter_dir = export_weights(model, trainer.tokenizer, cfg, 2, one_rank)
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k and ".default." not in k for k in adapter)
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "model.safetensors").exists()
