"""The content split: train and eval sides never share a problem (normalized prompt or order-free parameters)."""

from __future__ import annotations

import random

import pytest

from environments.bootcamp_tasks import FAMILIES, case_from_key
from environments.bootcamp_tasks.split import ContentSplit, build_eval_set, load_keys, overlap, problem_id
from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv

MIX = {"gcd": 1.0, "sorting": 1.0, "modulo": 1.0, "arithmetic": 1.0, "string_transform": 1.0}


def test_order_free_parameters_are_one_problem() -> None:
    gcd = FAMILIES["gcd"]
    a, b = (next(c for c in (gcd.case(1, s) for s in range(5000)) if c.prompt.startswith(p)) for p in ("gcd(6,9)", "gcd(9,6)"))
    assert a.prompt != b.prompt and problem_id(a) == problem_id(b)
    split = ContentSplit(0.5)
    assert split.side(a) == split.side(b)
    sort = FAMILIES["sorting"]
    cases = [sort.case(1, s) for s in range(3000)]
    by_id: dict[str, set[str]] = {}
    for case in cases:
        by_id.setdefault(problem_id(case), set()).add(case.prompt)
    assert any(len(prompts) > 1 for prompts in by_id.values())  # permutations of one list share an id


def test_prompt_normalization_ignores_case_space_and_answer_format() -> None:
    case = FAMILIES["modulo"].case(1, 7)
    same = type(case)(case.family, "modulo:1:99", "  " + case.prompt.upper().replace(" ", "   "), case.answer, 1)
    assert problem_id(same) == problem_id(case)


def test_train_side_items_never_meet_eval_sets() -> None:
    env = InternBootcampEnv(InternBootcampConfig(weights=MIX, difficulties=[1, 2], split="train"))
    trained = [env.get_item(i).answer for i in range(5000)]
    split = ContentSplit()
    assert all(split.side(c) == "train" for c in trained)
    for level in (1, 2, 3):
        evalset = build_eval_set(MIX, level, 60, split, min_problems=20)
        assert evalset.cases and not overlap(trained, evalset.cases)
        assert all(split.side(c) == "eval" for c in evalset.cases)
        assert len({problem_id(c) for c in evalset.cases}) == len(evalset.cases)  # distinct problems
    # the same env without a split trains on eval problems: the check can fail
    unsplit = InternBootcampEnv(InternBootcampConfig(weights=MIX, difficulties=[1]))
    assert overlap([unsplit.get_item(i).answer for i in range(5000)], build_eval_set(MIX, 1, 60, split).cases)


def test_eval_items_of_a_split_env_are_eval_side_and_planned_items_train_side() -> None:
    env = InternBootcampEnv(InternBootcampConfig(weights=MIX, split="train"))
    split = env.content_split
    assert all(split.side(env.get_eval_item(i).answer) == "eval" for i in range(200))
    plan = {"levels": {"gcd": 2, "sorting": 3}, "weights": {"gcd": 2.0}}
    assert all(split.side(env.get_planned_item(i, plan).answer) == "train" for i in range(300))


def test_split_all_keeps_the_old_items() -> None:
    old = InternBootcampEnv(InternBootcampConfig(weights=MIX))
    assert [old.get_item(i).key for i in range(50)] == [
        InternBootcampEnv(InternBootcampConfig(weights=MIX, split="all")).get_item(i).key for i in range(50)]


def test_small_spaces_are_marked_too_small() -> None:
    evalset = build_eval_set(["string_transform", "modulo"], 1, 60, ContentSplit(), min_problems=40)
    assert "string_transform" in evalset.too_small and evalset.too_small["string_transform"] < 28
    assert "modulo" not in evalset.too_small
    assert {c.family for c in evalset.headline()} == {"modulo"}


def test_eval_set_round_trips_through_keys(tmp_path) -> None:
    evalset = build_eval_set(["modulo"], 2, 10, ContentSplit())
    path = evalset.save(tmp_path / "eval.jsonl")
    assert [c.key for c in load_keys(path)] == [c.key for c in evalset.cases]
    (tmp_path / "bad.jsonl").write_text("not-a-key\n")
    with pytest.raises(ValueError, match="line 1"):
        load_keys(tmp_path / "bad.jsonl")


def test_a_side_with_no_problems_fails_with_a_message() -> None:
    with pytest.raises(ValueError, match="too small"):
        ContentSplit(0.001).draw(random.Random(0), "reverse", 1, "eval", max_tries=200)
    with pytest.raises(ValueError, match="eval_share"):
        ContentSplit(1.0)
    assert case_from_key("modulo:1:5").family == "modulo"
