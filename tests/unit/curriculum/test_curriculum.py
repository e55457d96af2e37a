"""The adaptive difficulty controller: climbs when solved, descends when not, holds inside the band, round-trips."""

from __future__ import annotations

import json
import random

import pytest

from factory.curriculum import Curriculum, CurriculumSettings, ItemOutcome


def chunk(family: str, level: int, pass_fraction: float, items: int = 8, group: int = 8) -> list[ItemOutcome]:
    passed = round(pass_fraction * group)
    return [ItemOutcome(family, level, passed, group, 0 < passed < group) for _ in range(items)]


def run(curriculum: Curriculum, policy, chunks: int, items: int = 8, seed: int = 0) -> list[dict[str, int]]:
    """Feed `chunks` chunks whose pass rate per item comes from policy(family, level, rng); return levels per chunk."""
    rng = random.Random(seed)
    levels = []
    for k in range(chunks):
        plan = curriculum.plan()["levels"]
        outcomes = []
        for family, level in plan.items():
            for _ in range(items):
                p = policy(family, level)
                passed = sum(rng.random() < p for _ in range(8))
                outcomes.append(ItemOutcome(family, level, passed, 8, 0 < passed < 8))
        curriculum.apply(k, outcomes)
        levels.append(curriculum.levels())
    return levels


def test_always_solved_family_climbs_to_the_top_and_never_solved_descends_to_the_bottom():
    c = Curriculum(CurriculumSettings(enabled=True), ["easy", "hard"], levels=(1, 5), start_level=3)
    levels = run(c, lambda family, level: 1.0 if family == "easy" else 0.0, chunks=6)
    assert [lv["easy"] for lv in levels] == [4, 5, 5, 5, 5, 5]
    assert [lv["hard"] for lv in levels] == [2, 1, 1, 1, 1, 1]
    assert [m["to"] for m in c.history if m["family"] == "easy"] == [4, 5]


@pytest.mark.parametrize("start", [1, 5])
def test_level_settles_where_the_pass_rate_is_inside_the_band(start):
    # always solved below level 3, never above it, half the time at 3: the only level inside [0.2, 0.8]
    c = Curriculum(CurriculumSettings(enabled=True), ["f"], levels=(1, 5), start_level=start)
    levels = run(c, lambda family, level: {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.0, 5: 0.0}[level], chunks=20)
    assert levels[-1]["f"] == 3
    assert all(lv["f"] == 3 for lv in levels[2:])  # two moves get there, then it stays
    assert 0.2 <= c.families["f"].pass_rate() <= 0.8


def test_in_band_family_stays_and_too_few_items_do_not_move_a_level():
    c = Curriculum(CurriculumSettings(enabled=True, min_items=6), ["mid", "sparse"], start_level=2)
    c.apply(0, chunk("mid", 2, 0.5) + chunk("sparse", 2, 1.0, items=3))
    assert c.levels() == {"mid": 2, "sparse": 2}
    c.apply(1, chunk("sparse", 2, 1.0, items=3))
    assert c.levels()["sparse"] == 3  # 6 items now


def test_items_drawn_at_an_old_level_do_not_count_toward_the_new_one():
    c = Curriculum(CurriculumSettings(enabled=True), ["f"], start_level=2)
    c.apply(0, chunk("f", 2, 1.0))
    assert c.levels()["f"] == 3
    c.apply(1, chunk("f", 2, 1.0))  # drawn before the move (pipeline lag)
    assert c.levels()["f"] == 3 and c.families["f"].window == [] and c.families["f"].items == 16


def test_reweighting_favours_families_that_still_give_kept_groups():
    settings = CurriculumSettings(enabled=True, reweight=True, min_weight=0.1)
    c = Curriculum(settings, ["learnable", "solved"], start_level=5)
    c.apply(0, chunk("learnable", 5, 0.5) + chunk("solved", 5, 1.0))
    weights = c.weights()
    assert weights == {"learnable": 1.0, "solved": 0.1}
    assert c.plan()["levels"] == {"learnable": 5, "solved": 5}  # top level: nowhere to climb


def test_state_round_trips_through_json_and_continues_identically():
    c = Curriculum(CurriculumSettings(enabled=True, reweight=True), ["a", "b", "c"], start_level=3,
                   base_weights={"a": 2.0, "b": 1.0, "c": 1.0})
    policy = lambda family, level: {"a": 0.9, "b": 0.1, "c": 0.5}[family]  # noqa: E731
    run(c, policy, chunks=3, seed=1)
    copy = Curriculum.from_dict(json.loads(json.dumps(c.to_dict())))
    assert copy.to_dict() == c.to_dict() and copy.plan() == c.plan()
    assert run(copy, policy, chunks=4, seed=2) == run(c, policy, chunks=4, seed=2)
    assert copy.to_dict() == c.to_dict()


def test_settings_refuse_an_empty_band():
    with pytest.raises(ValueError, match="band is empty"):
        CurriculumSettings(low=0.9, high=0.1)
