"""Train/eval splits by problem content: a problem is on the eval side or the train side for every run and level.

A case's side is a hash of its family and `identity` (the normalized prompt, or the order-free problem
parameters where a family has them), so two cases that are the same problem always land on the same side,
whatever their seed, index or difficulty. Training draws only train-side cases, evaluation only eval-side
ones, and `overlap` counts what two sets share, so a run can check the split before it starts.

    split = ContentSplit(eval_share=0.25)
    evalset = build_eval_set(["gcd", "modulo"], level=1, per_family=150, split=split)
    overlap(train_cases, evalset.cases)   # -> 0
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from environments.bootcamp_tasks.base import Case
from environments.bootcamp_tasks.mix import case_from_key, get_family

SIDES = ("all", "train", "eval")


def problem_id(case: Case) -> str:
    """The family plus what makes the case one problem (no seed, no level): equal ids are the same problem."""
    return f"{case.family}|{get_family(case.family).identity(case)}"


@dataclass(frozen=True)
class ContentSplit:
    """Which side a problem is on: a fixed hash of its id against `eval_share` (salt picks another split)."""

    eval_share: float = 0.25
    salt: str = "v1"

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_share < 1.0:
            raise ValueError(f"eval_share {self.eval_share} must be between 0 and 1 (exclusive), e.g. 0.25")

    def side(self, case: Case) -> str:
        digest = hashlib.sha256(f"{self.salt}|{problem_id(case)}".encode()).digest()
        return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < self.eval_share else "train"

    def draw(self, rng: random.Random, family: str, level: int, side: str, *, max_tries: int = 10_000) -> Case:
        """A case of `family` at `level` on `side` ("all": any), redrawing seeds from `rng` until one fits."""
        if side not in SIDES:
            raise ValueError(f"split side {side!r} is not one of {SIDES}")
        fam = get_family(family)
        for _ in range(max_tries):
            case = fam.generate(rng, level)
            if side == "all" or self.side(case) == side:
                return case
        raise ValueError(f"no {side}-side problem of {family} level {level} in {max_tries} draws; its problem space "
                         f"is too small for eval_share {self.eval_share}: use another family or level")


@dataclass
class EvalSet:
    """Distinct eval-side problems of one level, per family, and which families have too few to count."""

    level: int
    cases: list[Case]
    distinct: dict[str, int] = field(default_factory=dict)  # family -> distinct eval-side problems found
    too_small: dict[str, int] = field(default_factory=dict)  # family -> distinct found (< min_problems)

    def headline(self) -> list[Case]:
        """The cases of families whose space was large enough to give `per_family` distinct problems."""
        return [c for c in self.cases if c.family not in self.too_small]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text("".join(json.dumps({"key": c.key, "problem": problem_id(c)}) + "\n" for c in self.cases))
        return path


def build_eval_set(families: Iterable[str], level: int, per_family: int, split: ContentSplit, *,
                   min_problems: int | None = None, seed: int = 0, max_draws: int = 20_000) -> EvalSet:
    """Up to `per_family` distinct eval-side problems of each family at `level`, drawn by a fixed seed.

    A family with fewer than `min_problems` (default: `per_family`) distinct eval-side problems within
    `max_draws` draws is marked too small: its cases stay in the set but out of the headline.
    """
    min_problems = per_family if min_problems is None else min_problems
    out = EvalSet(level=level, cases=[])
    for family in families:
        fam = get_family(family)
        rng = random.Random(f"eval-set:{seed}:{family}:{level}")
        seen: dict[str, Case] = {}
        for _ in range(max_draws):
            case = fam.generate(rng, level)
            if split.side(case) == "eval":
                seen.setdefault(problem_id(case), case)
                if len(seen) >= per_family:
                    break
        out.cases.extend(seen.values())
        out.distinct[family] = len(seen)
        if len(seen) < min_problems:
            out.too_small[family] = len(seen)
    return out


def load_keys(path: str | Path) -> list[Case]:
    """Cases from a JSONL file of `{"key": "<family>:<difficulty>:<seed>"}` rows (or bare keys, one a line)."""
    cases = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        key = json.loads(line)["key"] if line.startswith("{") else line
        try:
            cases.append(case_from_key(key))
        except ValueError as error:
            raise ValueError(f"{path} line {n}: {error}") from None
    return cases


def overlap(a: Iterable[Case], b: Iterable[Case]) -> set[str]:
    """Problem ids present in both sets (normalized content / parameters, not keys)."""
    return {problem_id(c) for c in a} & {problem_id(c) for c in b}
