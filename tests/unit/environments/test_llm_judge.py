"""LLM judge: pairwise in both orders (position bias cancels), retries, failures counted and never scored."""

from __future__ import annotations

import asyncio
import re

import pytest

from environments.base import Rollout
from environments.llm_judge import Judge, LLMJudgeConfig, LLMJudgeEnv, both_orders, parse_verdict
from factory.inference.types import Completion


class FakeJudge:
    """A judge endpoint: `rule(a, b)` gives its reply text; counts requests."""

    def __init__(self, rule):
        self.rule, self.requests = rule, 0

    async def chat(self, messages, *, n, sampling):
        self.requests += 1
        text = messages[0]["content"]
        a = re.search(r"\[Answer A\]\n(.*?)\n\[/Answer A\]", text, re.S).group(1)
        b = re.search(r"\[Answer B\]\n(.*?)\n\[/Answer B\]", text, re.S).group(1)
        return [Completion(self.rule(a, b, sampling), None, None, None, "stop", 0, "judge")]


def longer(a, b, sampling):
    return "<verdict>tie</verdict>" if len(a) == len(b) else f"<verdict>{'A' if len(a) > len(b) else 'B'}</verdict>"


def env(**config) -> LLMJudgeEnv:
    return LLMJudgeEnv(LLMJudgeConfig(group_size=3, opponents=2, **config))


def judged(texts, rule, **config):
    e = env(**config)
    item = e.get_item(0)
    rollouts = [Rollout(item.key, t, [1], [2], None, "stop", 0) for t in texts]
    judge = Judge(FakeJudge(rule), e.config)
    asyncio.run(e.judge_group(item, rollouts, judge))
    return rollouts, judge


def test_verdict_parsing_right_wrong_and_malformed():
    assert parse_verdict("...<verdict>A</verdict>") == "A" and parse_verdict("<verdict> tie </verdict>") == "tie"
    assert parse_verdict("<verdict>b</verdict>") == "B"
    assert parse_verdict("<verdict>C</verdict>") is None and parse_verdict("I cannot decide.") is None
    assert parse_verdict("The lengths differ") is None and parse_verdict("") is None
    assert both_orders("A", "B") == 1.0 and both_orders("B", "A") == 0.0
    assert both_orders("A", "A") == 0.5 and both_orders("tie", "tie") == 0.5  # position bias cancels


@pytest.mark.parametrize("reply, verdict", [
    ("[[A]]", "A"), ("My final verdict is [[B]].", "B"), ("[[C]]", "tie"), ("Verdict: B", "B"),
    ("Final verdict: tie", "tie"), ('{"winner": "A"}', "A"), ("winner = answer B", "B"),
    ("Answer A is better because it cites the rubric.", "A"), ("Response B is preferred.", "B"), ("A", "A"),
    ("**B**", "B"), ("Tie.", "tie"), ("Answer A", "A"),
    ("Format: <verdict>A</verdict> or <verdict>B</verdict>. <verdict>B</verdict>", "B"),
])
def test_verdicts_in_common_formats(reply, verdict):
    assert parse_verdict(reply) == verdict


def test_group_is_ranked_by_pairwise_wins_in_both_orders():
    rollouts, judge = judged(["short", "a bit longer", "the longest answer of all"], longer)
    assert [r.score for r in rollouts] == [0.0, 0.5, 1.0] and all(r.error is None for r in rollouts)
    assert judge.counts["calls"] == 6  # 3 pairs x 2 orders


def test_a_judge_that_always_prefers_position_a_gives_no_signal():
    rollouts, _ = judged(["x", "yy", "zzz"], lambda a, b, s: "<verdict>A</verdict>")
    assert [r.score for r in rollouts] == [0.5, 0.5, 0.5]


def test_unusable_verdicts_are_retried_then_counted_never_scored():
    flaky = {"n": 0}

    def sometimes(a, b, sampling):
        flaky["n"] += 1
        return "hmm" if sampling.temperature == 0 else longer(a, b, sampling)  # the retry (temperature > 0) works

    rollouts, judge = judged(["a", "bb", "ccc"], sometimes)
    assert [r.score for r in rollouts] == [0.0, 0.5, 1.0] and judge.counts["retries"] == 6

    rollouts, judge = judged(["a", "bb", "ccc"], lambda a, b, s: "I refuse", judge_retries=1)
    assert all(r.score is None and r.error.startswith("judge_unparseable") for r in rollouts)
    assert judge.counts["failures"] >= 1 and judge.counts["unparseable"] >= 2

    def broken(a, b, sampling):
        raise ConnectionError("judge down")

    rollouts, _ = judged(["a", "bb"], broken)
    assert all(r.score is None and "judge down" in r.error and r.error.startswith("judge_error") for r in rollouts)


def test_failed_groups_are_dropped_as_failed_and_scorer_leaves_judged_rollouts_alone():
    from environments.base import EnvSpec
    from tasks.group import group_chunk
    from tasks.score import score_chunk

    e = env()
    item = e.get_item(0)
    good = [Rollout(item.key, t, [1], [2], None, "stop", 0, score=s) for t, s in (("a", 0.0), ("bb", 1.0), ("c", 0.5))]
    bad = [Rollout(item.key, "x", [1], [2], None, "stop", 0, error="judge_error: no verdict") for _ in range(3)]
    score_chunk(EnvSpec("environments.llm_judge:LLMJudgeEnv", {}), [item, item], [good, bad], mode="inline")
    grouped = group_chunk("llm_judge", [item, item], [good, bad], group_size=3, max_token_length=64)
    assert len(grouped.groups) == 1 and grouped.dropped["failed"] == 1
    assert grouped.groups[0].scores == [0.0, 1.0, 0.5]


def test_missing_judge_endpoint_says_how_to_set_it():
    with pytest.raises(ValueError, match="env.judge_block or env.judge.base_url"):
        env().judge_config()
    assert env(judge={"base_url": "http://h:1/v1"}).judge_config().base_url == "http://h:1/v1"
