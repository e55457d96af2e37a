"""`RandomTask`: a weighted mix of task families over a range of difficulties, and the family registry."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from environments.bootcamp_tasks import numeric, puzzles, text
from environments.bootcamp_tasks.base import Case, TaskFamily, check_difficulty, parse_key

FAMILIES: dict[str, TaskFamily] = {f.name: f for f in (*numeric.FAMILIES, *text.FAMILIES, *puzzles.FAMILIES)}
"""Every task family by name."""


def get_family(name: str) -> TaskFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown task family {name!r}; known families: {', '.join(sorted(FAMILIES))}") from None


def case_from_key(key: str) -> Case:
    """Rebuild a case from its key `"<family>:<difficulty>:<seed>"`."""
    family, difficulty, seed = parse_key(key)
    return get_family(family).case(difficulty, seed)


class RandomTask:
    """Draw cases from several families by weight, at difficulties drawn from `difficulties`."""

    def __init__(self, weights: Mapping[str, float] | None = None, difficulties: Sequence[int] = (1,)) -> None:
        weights = dict(weights) if weights else {name: 1.0 for name in FAMILIES}
        for name, weight in weights.items():
            get_family(name)
            if weight < 0:
                raise ValueError(f"weight of task family {name!r} is {weight}; weights must be >= 0")
        self.names = [name for name, weight in weights.items() if weight > 0]
        if not self.names:
            raise ValueError("every task family weight is 0; give at least one family a positive weight")
        self.weights = [weights[name] for name in self.names]
        if not difficulties:
            raise ValueError("difficulties is empty; give at least one level, e.g. [1]")
        self.difficulties = [check_difficulty(d) for d in difficulties]

    def generate(self, rng: random.Random, difficulty: int | None = None) -> Case:
        """A case from a family chosen by weight; difficulty drawn from the configured levels unless given."""
        family = FAMILIES[rng.choices(self.names, weights=self.weights)[0]]
        level = difficulty if difficulty is not None else rng.choice(self.difficulties)
        return family.generate(rng, level)

    def score(self, case: Case, completion: str, rewards=None) -> float:
        return FAMILIES[case.family].score(case, completion, rewards)

    def reference_completion(self, case: Case) -> str:
        return FAMILIES[case.family].reference_completion(case)
