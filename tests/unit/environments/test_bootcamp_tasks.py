"""Every InternBootcamp task family: deterministic, self-consistent, and scored like Atropos's env."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from environments.bootcamp_tasks import (
    FAMILIES,
    MAX_DIFFICULTY,
    RandomTask,
    RewardConfig,
    case_from_key,
    extract_answer,
)

LEVELS = range(1, MAX_DIFFICULTY + 1)
REQUIRED = {
    "arithmetic", "linear_equation", "sorting", "letter_count", "reverse", "string_transform",
    "base_conversion", "date_arithmetic", "logic_grid", "cryptarithm", "shortest_path",
}


def test_at_least_twelve_families_including_the_issue_list():
    assert len(FAMILIES) >= 12
    assert REQUIRED <= set(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_same_seed_same_case_and_key_rebuilds_it(name):
    family = FAMILIES[name]
    for level in LEVELS:
        first = [family.generate(random.Random(7), level) for _ in range(3)]
        again = [family.generate(random.Random(7), level) for _ in range(3)]
        assert first == again
        for case in first:
            assert case.key.startswith(f"{name}:{level}:")
            assert case_from_key(case.key) == case
            assert case.family == name and case.difficulty == level


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reference_scores_one_wrong_lower_missing_lowest(name):
    family = FAMILIES[name]
    rng = random.Random(1)
    for level in LEVELS:
        for _ in range(20):
            case = family.generate(rng, level)
            best = family.score(case, family.reference_completion(case))
            wrong = family.score(case, "<answer>definitely-not-it 99999</answer>")
            missing = family.score(case, case.answer)  # right text, but no answer tag
            assert best == 1.0, case
            assert missing < wrong < best


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_level_one_is_small_enough_for_a_tiny_policy(name):
    family = FAMILIES[name]
    rng = random.Random(3)
    for _ in range(100):
        case = family.generate(rng, 1)
        assert len(case.prompt) < 150, case.prompt
        assert len(family.reference_completion(case)) < 60


def test_reward_mapping_matches_atropos_intern_bootcamp_defaults():
    case = FAMILIES["arithmetic"].case(1, 5)
    family = FAMILIES["arithmetic"]
    assert family.score(case, f"<answer>{case.answer}</answer>") == 1.0
    assert family.score(case, "<answer>-1</answer>") == pytest.approx(-0.3)
    assert family.score(case, "no idea") == -0.5
    custom = RewardConfig(correct_reward=2.0, incorrect_reward=0.0, format_bonus=0.1)
    assert family.score(case, "<answer>-1</answer>", custom) == pytest.approx(0.1)


def test_answer_is_taken_after_thinking_and_the_last_tag_wins():
    assert extract_answer("<think>maybe <answer>1</answer></think> so <answer>2</answer>") == "2"
    assert extract_answer("<think>unfinished <answer>1</answer>") is None
    assert extract_answer("<answer> 3 </answer> and <answer>4</answer>") == "4"


def test_checks_are_tolerant_where_a_human_would_be():
    sort = FAMILIES["sorting"]
    case = sort.case(1, 11)
    spaced = case.answer.replace(",", ", ")
    assert sort.score(case, f"<answer>[{spaced}]</answer>") == 1.0
    linear = FAMILIES["linear_equation"]
    case = linear.case(2, 4)
    assert linear.score(case, f"<answer>x = {case.answer}</answer>") == 1.0


def test_random_task_respects_weights_and_levels():
    mix = RandomTask({"arithmetic": 3.0, "reverse": 1.0, "sorting": 0.0}, difficulties=[1, 2])
    rng = random.Random(0)
    cases = [mix.generate(rng) for _ in range(400)]
    counts = {name: sum(c.family == name for c in cases) for name in ("arithmetic", "reverse", "sorting")}
    assert counts["sorting"] == 0
    assert 2.0 < counts["arithmetic"] / counts["reverse"] < 4.5
    assert {c.difficulty for c in cases} == {1, 2}
    assert all(mix.score(c, mix.reference_completion(c)) == 1.0 for c in cases)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": {"arithmetc": 1.0}}, "did you mean|known families"),
        ({"weights": {"arithmetic": 0.0}}, "positive weight"),
        ({"difficulties": [9]}, "difficulty 9"),
    ],
)
def test_bad_mix_config_names_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandomTask(**kwargs)


def test_bad_key_names_the_expected_form():
    with pytest.raises(ValueError, match="<family>:<difficulty>:<seed>"):
        case_from_key("arithmetic-1-2")


def test_arithmetic_answers_are_the_expressions_python_value():
    """The answer is computed without eval; it must be what Python makes of the prompt's expression, at every
    level (precedence and signs included), so no stored item's answer changes."""
    arithmetic = FAMILIES["arithmetic"]
    for level in LEVELS:
        for seed in range(500):
            question, answer = arithmetic.make(random.Random(seed), level)
            expression = question.removeprefix("Compute ").removesuffix(".")
            assert set(expression) <= set("0123456789+-*")
            assert answer == str(eval(expression))  # noqa: S307 - digits and + - * only, checked above
    assert arithmetic.make(random.Random(3), 1) == ("Compute 40+85.", "125")  # the draws themselves are unchanged


def _extract_answer_with_the_regex_always(completion: str) -> str | None:
    """extract_answer as it was before it skipped the think regex on replies without a think tag."""
    import re

    visible = re.sub(r"<think>.*?</think>", "", completion, flags=re.DOTALL | re.IGNORECASE)
    if "<think>" in visible.lower():
        visible = visible[: visible.lower().index("<think>")]
    found = re.findall(r"<answer>(.*?)</answer>", visible, flags=re.DOTALL | re.IGNORECASE)
    return found[-1].strip() if found else None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<THINK>", "</Think>", "<thİnk>", "<thinK>", "<answer>",
                                 "</answer>", "<ANSWER>", " 12 ", "x", "\n", "İ", "K", "<thınk>", "\u212a", "ı",
                                 "th", "ink>", "<"]), max_size=12))
def test_extract_answer_is_what_it_was_with_the_think_regex_always_run(parts):
    text = "".join(parts)
    assert extract_answer(text) == _extract_answer_with_the_regex_always(text)


@pytest.mark.parametrize("opening", ["<thİnk>", "<thınk>", "<thin\u212a>", "<THINK>"])
def test_a_think_block_opened_with_letters_ignorecase_matches_is_cut(opening):
    # The regex matches these openings to <think> (IGNORECASE), str.lower() does not for the first three.
    text = f"<answer>2</answer>{opening}<answer>1</answer></think>"
    assert extract_answer(text) == _extract_answer_with_the_regex_always(text) == "2"
