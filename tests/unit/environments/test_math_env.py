"""MATH: problems through datasets.load_dataset on the project's own file; boxed answers checked by math-verify
with equivalent forms (fractions, radicals, intervals, sets, units, degrees)."""

from __future__ import annotations

import pytest

from environments.math_env import SAMPLE_FILE, MathConfig, MathEnv, gold_answer, last_boxed


@pytest.fixture(scope="module")
def env() -> MathEnv:
    env = MathEnv(MathConfig(data_file=str(SAMPLE_FILE)))
    env.setup()
    return env


def item_with(env: MathEnv, gold: str):
    return next(env.get_item(i) for i in range(len(env.rows)) if env.get_item(i).answer == gold)


@pytest.mark.parametrize(("gold", "right", "wrong"), [
    ("\\frac{1}{2}", "0.5", "\\frac{1}{3}"),
    ("\\frac{3}{8}", "\\dfrac{3}{8}", "0.38"),
    ("2\\sqrt{2}", "\\sqrt{8}", "\\sqrt{2}"),
    ("(-\\infty, 3]", "(-\\infty,3]", "(-\\infty, 3)"),
    ("(-2, 2)", "(-2,2)", "[-2, 2]"),
    ("\\{2,3\\}", "\\{3, 2\\}", "\\{2\\}"),
    ("5\\text{ cm}", "5", "7\\text{ cm}"),
    ("120^\\circ", "120", "60^\\circ"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", "\\frac{\\sqrt{2}}{2}"),
    ("x^2+2x+1", "(x+1)^2", "x^2+1"),
    ("18.90", "18.9", "19"),
])
def test_equivalent_forms_right_and_wrong(env, gold, right, wrong):
    item = item_with(env, gold)
    assert env.score(item, f"Work... so the answer is $\\boxed{{{right}}}$.") == 1.0
    assert env.score(item, f"\\boxed{{{wrong}}}") == 0.0


def test_malformed_answers_score_zero(env):
    item = item_with(env, "6")
    assert env.score(item, "The answer is 6.") == 0.0                     # no box: not accepted
    assert env.score(item, "\\boxed{6") == 0.0                            # unclosed box
    assert env.score(item, "<think>\\boxed{6}</think> no idea") == 0.0    # box only inside thinking
    assert env.score(item, "\\boxed{5} then \\boxed{6}") == 1.0           # the last box counts
    assert last_boxed("\\boxed{\\frac{1}{2}} x") == "\\frac{1}{2}"


def test_items_come_from_the_file_through_datasets_with_subjects(env):
    assert len(env.rows) == 24 and len({env.get_item(i).key for i in range(48)}) == 48
    items = [env.get_eval_item(i) for i in range(24)]
    completions = [f"\\boxed{{{i.answer}}}" if i.info["subject"] == "Algebra" else "?" for i in items]
    metrics = env.eval_metrics(items, completions)
    assert metrics["accuracy/Algebra"] == 1.0 and metrics["accuracy/Geometry"] == 0.0
    assert gold_answer({"problem": "p", "solution": "so $\\boxed{\\frac{1}{2}}$"}) == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="no 'answer'"):
        gold_answer({"problem": "p", "solution": "none"})
