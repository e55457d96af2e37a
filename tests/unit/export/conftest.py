"""Fixtures for export tests: a tiny chat tokenizer built here, and small stores of synthetic groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from environments.groups import MASK_IGNORE, ScoredGroup
from factory.store import ShardStore
from factory.synthetic import synthetic_groups

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer with a chat template, saved as a Hugging Face tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["What is 2 + 2? The answer is \\boxed{4}. <think>adding</think>"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True)
def _decode_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizer decoders an export saves (factory/export/decode_cache.py) go to this test's tmp dir, not ~/.cache."""
    monkeypatch.setenv("FACTORY_DECODE_CACHE", str(tmp_path / "decode-cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def scored(scores: list[float], *, index: int = 0, env: str = "math", run_id: str = "run-1", lengths: list[int] | None = None,
           messages: bool = True) -> ScoredGroup:
    """A group with given scores; completion k answers `k`, prompt is two tokens."""
    lengths = lengths or [6] * len(scores)
    tokens = [[1, 2] + [10 + k] * (n - 2) for k, n in enumerate(lengths)]
    masks = [[MASK_IGNORE, MASK_IGNORE] + t[2:] for t in tokens]
    convo = [
        [{"role": "user", "content": f"q{index}"}, {"role": "assistant", "content": f"a{index}-{k}"}]
        for k in range(len(scores))
    ]
    return ScoredGroup(tokens=tokens, masks=masks, scores=scores, messages=convo if messages else None, env=env,
                       run_id=run_id, item_key=f"{env}:{index}")


@pytest.fixture
def synthetic_store(tmp_path: Path) -> ShardStore:
    """Two runs of synthetic groups (two envs in run-a), three shards."""
    store = ShardStore(tmp_path / "store")
    store.commit("run-a", "w0", 0, list(synthetic_groups(40, env="math", run_id="run-a")))
    store.commit("run-a", "w1", 0, list(synthetic_groups(40, start=40, env="code", run_id="run-a")))
    store.commit("run-b", "w0", 0, list(synthetic_groups(30, start=100, env="math", run_id="run-b")))
    return store
