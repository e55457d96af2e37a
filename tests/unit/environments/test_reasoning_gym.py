"""reasoning-gym: datasets by name or weighted mix, difficulty knobs, its scorer as the reward."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from environments.base import EVAL_INDEX_OFFSET  # noqa: E402
from environments.reasoning_gym_env import ReasoningGymConfig, ReasoningGymEnv  # noqa: E402


def test_right_wrong_and_malformed_answers():
    env = ReasoningGymEnv(ReasoningGymConfig(dataset="basic_arithmetic"))
    item = env.get_item(0)
    gold = item.answer["answer"]
    assert item.messages[-1]["content"] == item.answer["question"]
    assert env.score(item, f"<think>hmm</think><answer>{gold}</answer>") == 1.0
    assert env.score(item, f"<answer>{int(gold) + 1}</answer>") == 0.0
    assert env.score(item, gold) == 0.0                   # no answer tag
    assert env.score(item, "<answer>banana") == 0.0       # unclosed tag
    assert env.is_correct(item, f"<answer> {gold} </answer>")


def test_items_are_fixed_by_seed_and_index_and_eval_differs():
    a, b = (ReasoningGymEnv(ReasoningGymConfig(dataset="word_sorting", seed=2)) for _ in range(2))
    assert [a.get_item(i) for i in range(5)] == [b.get_item(i) for i in range(5)]
    assert a.get_eval_item(0).answer != a.get_item(0).answer
    assert a.get_eval_item(0).key.endswith(str(EVAL_INDEX_OFFSET))


def test_weighted_mix_and_per_dataset_metrics():
    env = ReasoningGymEnv(ReasoningGymConfig(mix={"basic_arithmetic": 3, "word_sorting": 1, "chain_sum": 0}))
    names = [env.get_item(i).info["dataset"] for i in range(200)]
    assert 110 < names.count("basic_arithmetic") < 190 and "chain_sum" not in names
    items = [env.get_item(i) for i in range(8)]
    completions = [f"<answer>{i.answer['answer']}</answer>" for i in items[:4]] + ["no"] * 4
    metrics = env.eval_metrics(items, completions)
    assert metrics["accuracy"] == 0.5 and {k for k in metrics if k.startswith("accuracy/")} <= {
        "accuracy/basic_arithmetic", "accuracy/word_sorting"}


def test_difficulty_knobs_level_and_dataset_config():
    easy = ReasoningGymEnv(ReasoningGymConfig(dataset="basic_arithmetic", level=0))
    hard = ReasoningGymEnv(ReasoningGymConfig(dataset="basic_arithmetic", level=3))
    assert easy.dataset_settings("basic_arithmetic")["max_terms"] < hard.dataset_settings("basic_arithmetic")["max_terms"]
    pinned = ReasoningGymEnv(ReasoningGymConfig(dataset="basic_arithmetic", level=3,
                                                dataset_config={"basic_arithmetic": {"max_terms": 2, "min_terms": 2}}))
    assert all(pinned.get_item(i).answer["metadata"]["num_terms"] == 2 for i in range(10))
    assert easy.get_item(0).key != hard.get_item(0).key  # the level is part of the item key


@pytest.mark.parametrize(("values", "message"), [
    ({"dataset": "basic_arithmetik"}, "unknown reasoning-gym datasets"),
    ({"mix": {"chain_sum": 0}}, "positive sum"),
])
def test_bad_config_names_the_problem(values, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymConfig(**values)
