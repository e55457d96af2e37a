"""Grouping rollouts: token/mask/logprob alignment, group ids, and every drop reason counted."""

from __future__ import annotations

from environments.base import Item, Rollout
from environments.groups import MASK_IGNORE, make_group_id
from tasks.group import build_group, group_chunk

ITEM = Item(key="arithmetic:1:7", messages=[{"role": "user", "content": "Compute 1+1."}], answer="2")


def rollout(score: float | None, out: tuple[int, ...] = (7, 8), *, error: str | None = None, version: int = 3) -> Rollout:
    return Rollout(ITEM.key, f"text{score}", [1, 2, 3], list(out), [-0.5] * len(out), "stop", version, score=score,
                   error=error)


def test_tokens_masks_and_logprobs_line_up_and_prompt_is_masked():
    group = build_group("ib", ITEM, [rollout(1.0), rollout(-0.5, [9, 10, 11], version=2)], group_size=2,
                        max_token_length=100, run_id="r", seed=5)
    assert group.tokens == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 10, 11]]
    assert group.masks == [[MASK_IGNORE] * 3 + [7, 8], [MASK_IGNORE] * 3 + [9, 10, 11]]
    assert group.inference_logprobs[1] == [1.0, 1.0, 1.0, -0.5, -0.5, -0.5]
    assert group.scores == [1.0, -0.5]
    assert group.messages[0][-1] == {"role": "assistant", "content": "text1.0"}
    assert group.policy_version == 2  # the oldest policy in the group bounds its staleness
    assert group.group_id == make_group_id("ib", ITEM.key, 5, 2)


def test_missing_logprobs_leave_the_field_empty_rather_than_misaligned():
    bad = rollout(0.0)
    bad.output_logprobs = None
    group = build_group("ib", ITEM, [rollout(1.0), bad], group_size=2, max_token_length=100)
    assert group.inference_logprobs is None


def test_each_drop_reason_is_counted():
    items = [ITEM] * 5
    rollouts = [
        [rollout(1.0), rollout(0.0)],                           # kept
        [rollout(1.0), rollout(1.0)],                           # equal_scores
        [rollout(1.0), rollout(0.0, list(range(200)))],         # too_long
        [rollout(1.0)],                                         # wrong_size
        [rollout(1.0), rollout(None, error="score_timeout")],   # failed
    ]
    result = group_chunk("ib", items, rollouts, group_size=2, max_token_length=50)
    assert len(result.groups) == 1
    assert dict(result.dropped) == {"equal_scores": 1, "too_long": 1, "wrong_size": 1, "failed": 1}
    stats = result.stats()
    assert stats["groups_kept"] == 1 and stats["rollouts"] == 9
    assert stats["scored"] == 8


def test_equal_scores_are_kept_when_the_env_allows_it():
    result = group_chunk("ib", [ITEM], [[rollout(1.0), rollout(1.0)]], group_size=2, max_token_length=50,
                         ensure_scores_are_not_same=False)
    assert len(result.groups) == 1


def test_group_ids_are_the_sha256_of_the_json_key_they_always_were():
    """make_group_id writes its key without json.dumps; ids must not change (resumes and dedup match on them)."""
    import hashlib
    import json

    for env, key, seed, version in [("ib", "arithmetic:1:42", 0, 0), ("é\"\\\n\t\x01", "鍵 😀 \u2028", "s", 7),
                                    ("", "", -3, True)]:
        text = json.dumps([env, key, str(seed), int(version)], ensure_ascii=False)
        assert make_group_id(env, key, seed, version) == hashlib.sha256(text.encode()).hexdigest()[:32]
    assert make_group_id("ib", "arithmetic:1:42", 0, 0) == "87132e8467f3e3a8c399e954bfdb5c05"  # as before the change
