"""Synthetic but realistic `ScoredGroup`s for tests, benchmarks and notebooks.

Shapes follow a real rollout: a shared prompt with masks of -100, a completion
whose mask is its own token ids, inference logprobs aligned to tokens (1.0 on
prompt positions, as Atropos sends them), chat messages and a reward per
sequence. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime, timezone

from environments.groups import MASK_IGNORE, ScoredGroup, make_group_id


def synthetic_group(
    index: int,
    *,
    group_size: int = 8,
    seq_len: int = 64,
    prompt_len: int | None = None,
    env: str = "synthetic",
    run_id: str = "synthetic",
    policy_version: int = 0,
    vocab: int = 32000,
    seed: int = 0,
) -> ScoredGroup:
    rng = random.Random(seed * 1_000_003 + index)
    prompt_len = prompt_len if prompt_len is not None else max(1, seq_len // 4)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    tokens, masks, logprobs, messages, scores = [], [], [], [], []
    for k in range(group_size):
        completion = [rng.randrange(vocab) for _ in range(max(1, seq_len - prompt_len))]
        tokens.append(prompt + completion)
        masks.append([MASK_IGNORE] * prompt_len + completion)
        logprobs.append([1.0] * prompt_len + [-rng.random() * 5 for _ in completion])
        scores.append(float(rng.choice([1.0, 0.0, -1.0])) if k else 1.0)
        messages.append(
            [
                {"role": "user", "content": f"Question {index}: what is {index} + 1?"},  # one prompt per group
                {"role": "assistant", "content": f"<think>adding</think> \\boxed{{{index + k}}}"},
            ]
        )
    item_key = f"item-{index}"
    return ScoredGroup(
        tokens=tokens,
        masks=masks,
        scores=scores,
        inference_logprobs=logprobs,
        messages=messages,
        generation_params={"temperature": 1.0, "n": group_size},
        group_id=make_group_id(env, item_key, seed, policy_version),
        env=env,
        item_key=item_key,
        policy_version=policy_version,
        run_id=run_id,
        created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
    )


def synthetic_groups(count: int, *, start: int = 0, **kwargs) -> Iterator[ScoredGroup]:
    """`count` groups with indices start..start+count-1 (see `synthetic_group` for options)."""
    for index in range(start, start + count):
        yield synthetic_group(index, **kwargs)
