"""Multiple choice: letter extraction over the usual phrasings, right/wrong/malformed rewards, per-subject accuracy."""

from __future__ import annotations

import pytest

from environments.multiple_choice import SAMPLE_FILE, MultipleChoiceConfig, MultipleChoiceEnv, extract_letter

CHOICES = ["Venus", "Earth", "Mars", "Mercury"]


@pytest.mark.parametrize(("completion", "letter"), [
    ("<answer>D</answer>", "D"),
    ("<answer>(d)</answer>", "D"),
    ("<answer> D. Mercury</answer>", "D"),
    ("The answer is (C).", "C"),
    ("the answer is C", "C"),
    ("Answer: B", "B"),
    ("**Answer:** **B**", "B"),
    ("The correct answer is option A because...", "A"),
    ("So the correct option is: D", "D"),
    ("I choose B.", "B"),
    ("$\\boxed{C}$", "C"),
    ("\\boxed{\\text{D}}", "D"),
    ("D", "D"),
    ("(B)", "B"),
    ("B) Earth", "B"),
    ("Let me think.\nC.", "C"),
    ("<think>maybe A</think> Answer: D", "D"),
    ("It is Mercury, the innermost planet.", "D"),
    ("I think it's Earth or Mars.", None),     # two options quoted: ambiguous
    ("No idea.", None),
    ("The answer is E", None),                  # not an option here
    ("", None),
    ("A quick thought: planets orbit.", None),  # the article 'A' is not an answer
])
def test_letter_extraction(completion, letter):
    assert extract_letter(completion, CHOICES) == letter


@pytest.fixture(scope="module")
def env() -> MultipleChoiceEnv:
    return MultipleChoiceEnv(MultipleChoiceConfig(data_file=str(SAMPLE_FILE)))


def test_right_wrong_and_malformed_answers(env):
    item = env.get_item(0)
    wrong = "A" if item.answer != "A" else "B"
    assert "A. " in item.messages[-1]["content"] and item.answer in "ABCD"
    assert env.score(item, f"The answer is ({item.answer}).") == 1.0
    assert env.score(item, f"<answer>{wrong}</answer>") == 0.0
    assert env.score(item, "<answer></answer> hmm") == 0.0


def test_per_subject_accuracy_in_evaluate_metrics(env):
    items = [env.get_eval_item(i) for i in range(16)]
    completions = [f"Answer: {i.answer}" if i.info["subject"] == "astronomy" else "pass" for i in items]
    metrics = env.eval_metrics(items, completions)
    assert metrics["accuracy/astronomy"] == 1.0 and metrics["accuracy/computer_security"] == 0.0
    assert metrics["accuracy"] == pytest.approx(3 / 16) and metrics["answered"] == pytest.approx(3 / 16)


def test_shuffled_choices_keep_the_right_answer():
    plain = MultipleChoiceEnv(MultipleChoiceConfig(data_file=str(SAMPLE_FILE)))
    shuffled = MultipleChoiceEnv(MultipleChoiceConfig(data_file=str(SAMPLE_FILE), shuffle_choices=True))
    for i in range(16):
        a, b = plain.get_item(i), shuffled.get_item(i)
        assert a.info["choices"]["ABCD".index(a.answer)] == b.info["choices"]["ABCD".index(b.answer)]
    assert any(plain.get_item(i).answer != shuffled.get_item(i).answer for i in range(16))
