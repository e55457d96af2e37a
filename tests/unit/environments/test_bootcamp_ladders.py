"""Ladders without cliffs: from one level to the next, sorting, reverse and string_transform change one thing."""

from __future__ import annotations

import re

from environments.bootcamp_tasks import FAMILIES


def _cases(family: str, level: int, n: int = 300):
    return [FAMILIES[family].case(level, seed) for seed in range(n)]


def test_sorting_adds_a_number_before_it_adds_digits() -> None:
    shape = {}
    for level in (1, 2, 3):
        lists = [list(map(int, re.findall(r"\d+", c.prompt.split("Put")[0]))) for c in _cases("sorting", level)]
        shape[level] = ({len(v) for v in lists}, max(max(v) for v in lists))
    assert shape[1] == ({3}, 9) and shape[2] == ({4}, 9)  # level 2: one more number, still digits
    assert shape[3][0] == {4} and 9 < shape[3][1] <= 99  # level 3: same count, two-digit numbers


def test_word_families_grow_words_one_letter_before_new_operations() -> None:
    def words(family: str, level: int) -> set[int]:
        return {len(re.search(r"'(\w+)'", c.prompt).group(1)) for c in _cases(family, level)}

    assert words("reverse", 1) == {3} and words("reverse", 2) == {4} and min(words("reverse", 3)) >= 5
    assert words("string_transform", 2) == {4}
    ops = {c.prompt.split(" ")[0] for c in _cases("string_transform", 2)}
    assert ops == {"Uppercase", "Remove"}  # level 1's operations on longer words; initials and shifts at level 3
    assert {c.prompt.split(" ")[0] for c in _cases("string_transform", 3)} >= {"First", "Shift"}
