"""Scoring in scorer processes: right scores, a per-item timeout that costs one item, errors recorded as data."""

from __future__ import annotations

import time

from environments.base import BaseEnv, EnvSpec, Item, Rollout
from environments.intern_bootcamp import InternBootcampEnv
from tasks.score import score_chunk


class SlowEnv(BaseEnv):
    """Scores 'sleep' by hanging, 'boom' by raising, anything else by its length."""

    name = "slow"

    def get_item(self, index: int) -> Item:
        return Item(key=f"slow:{index}", messages=[{"role": "user", "content": "x"}])

    def score(self, item: Item, completion: str) -> float:
        if completion == "sleep":
            time.sleep(30)
        if completion == "boom":
            raise ValueError("cannot parse")
        return float(len(completion))


def rollouts_for(item: Item, texts: list[str]) -> list[Rollout]:
    return [Rollout(item.key, t, [1], [2], None, "stop", 0) for t in texts]


def test_process_scoring_matches_the_env_and_isolates_a_hung_item():
    spec = EnvSpec(f"{__name__}:SlowEnv", {})
    env = SlowEnv()
    items = [env.get_item(i) for i in range(3)]
    rollouts = [rollouts_for(items[0], ["ab", "abc"]), rollouts_for(items[1], ["sleep", "x"]),
                rollouts_for(items[2], ["boom", "abcd"])]
    started = time.monotonic()
    scored = score_chunk(spec, items, rollouts, timeout_s=1.0, workers=2, mode="process")
    assert time.monotonic() - started < 20
    assert [r.score for r in scored[0]] == [2.0, 3.0]
    assert [r.error for r in scored[1]] == ["score_timeout", "score_timeout"]
    assert scored[2][0].score is None and scored[2][0].error.startswith("score_error: ValueError")
    assert scored[2][1].score == 4.0


def test_inline_scoring_of_intern_bootcamp_uses_the_reward_mapping():
    env = InternBootcampEnv()
    spec = EnvSpec("environments.intern_bootcamp:InternBootcampEnv", env.config.model_dump(mode="json"))
    item = env.get_item(0)
    texts = [f"<answer>{item.answer.answer}</answer>", "<answer>nope</answer>", "no tag"]
    scored = score_chunk(spec, [item], [rollouts_for(item, texts)], mode="inline")
    assert [r.score for r in scored[0]] == [1.0, -0.3, -0.5]


def test_rollouts_that_failed_to_generate_are_not_scored():
    env = InternBootcampEnv()
    spec = EnvSpec("environments.intern_bootcamp:InternBootcampEnv", {})
    item = env.get_item(1)
    failed = Rollout(item.key, "", None, None, None, "abort", 0, error="generate_error: boom")
    scored = score_chunk(spec, [item], [[failed]], mode="inline")
    assert scored[0][0].score is None and scored[0][0].error == "generate_error: boom"
