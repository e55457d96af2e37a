"""The shape every InternBootcamp task family shares: a seeded case, a prompt, answer extraction and a verifier.

A case is a pure function of (family, difficulty, seed), so its key
`"<family>:<difficulty>:<seed>"` is enough to rebuild it anywhere (a resumed
chunk, a scorer in another process). Answers go in `<answer>…</answer>`; the
reward mapping follows Atropos's InternBootcamp env: the verifier gives 1.0
for a correct answer, `format_score` for a formatted but wrong one and 0.0 for
no answer, then `correct_reward` / `incorrect_reward + format_score` /
`incorrect_reward` are what a group is scored with.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from pydantic import Field

from factory.config import FactoryConfig

MIN_DIFFICULTY = 1
MAX_DIFFICULTY = 5
ANSWER_FORMAT = "Put the answer in <answer></answer>."

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)


class RewardConfig(FactoryConfig):
    """How verifier outcomes map to rewards (Atropos InternBootcamp defaults)."""

    correct_reward: float = Field(1.0, description="Reward for a correct, well-formatted answer.")
    incorrect_reward: float = Field(-0.5, description="Reward for a wrong or missing answer.")
    format_bonus: float = Field(0.2, ge=0.0, lt=1.0, description="Added to incorrect_reward when the answer is formatted but wrong.")


@dataclass(frozen=True)
class Case:
    """One generated problem: everything needed to prompt and to verify."""

    family: str
    key: str
    prompt: str
    answer: str
    difficulty: int


def parse_key(key: str) -> tuple[str, int, int]:
    """Split `"<family>:<difficulty>:<seed>"`; the message says what a key looks like."""
    parts = key.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"case key {key!r} is not of the form '<family>:<difficulty>:<seed>' (e.g. 'arithmetic:1:42')")
    return parts[0], int(parts[1]), int(parts[2])


def extract_answer(completion: str) -> str | None:
    """The text of the last `<answer>` tag outside any `<think>` block, or None."""
    visible = completion
    # The regex also finds the non-ASCII letters IGNORECASE matches to ASCII ones ('<thİnk>'); an ASCII reply has
    # none, and `in` over its lower case says the same at a fraction of the cost (the scorer runs per rollout).
    if "<think>" in completion.lower() or (not completion.isascii() and _THINK_OPEN.search(completion)):
        visible = _THINK.sub("", completion)
        if "<think>" in visible.lower():
            # An unclosed think block: nothing after it counts as an answer.
            visible = visible[: visible.lower().index("<think>")]
    found = _ANSWER.findall(visible)
    return found[-1].strip() if found else None


def check_difficulty(difficulty: int) -> int:
    if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty {difficulty} is out of range; use {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
    return difficulty


class TaskFamily:
    """A family of procedurally generated, verifiable problems; subclasses give `make` (and `check` if needed)."""

    name: str = ""
    description: str = ""

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        """Return (question, canonical answer) for this difficulty, drawing only from `rng`."""
        raise NotImplementedError(f"{type(self).__name__} must implement make(rng, difficulty)")

    def check(self, expected: str, given: str) -> bool:
        """Whether an extracted answer matches the canonical one (default: case- and space-insensitive)."""
        return _norm(given) == _norm(expected)

    def generate(self, rng: random.Random, difficulty: int) -> Case:
        """Draw a seed from `rng` and build the case it names."""
        return self.case(difficulty, rng.getrandbits(32))

    def case(self, difficulty: int, seed: int) -> Case:
        check_difficulty(difficulty)
        question, answer = self.make(random.Random(f"{self.name}:{difficulty}:{seed}"), difficulty)
        return Case(
            family=self.name,
            key=f"{self.name}:{difficulty}:{seed}",
            prompt=f"{question} {ANSWER_FORMAT}",
            answer=answer,
            difficulty=difficulty,
        )

    def verify_score(self, case: Case, completion: str, format_score: float = 0.2) -> float:
        """1.0 correct, `format_score` formatted but wrong, 0.0 when there is no answer tag."""
        given = extract_answer(completion)
        if given is None:
            return 0.0
        try:
            correct = self.check(case.answer, given)
        except (ValueError, TypeError, OverflowError):
            correct = False
        return 1.0 if correct else format_score

    def score(self, case: Case, completion: str, rewards: RewardConfig | None = None) -> float:
        """The reward for a completion, mapped as Atropos's InternBootcamp env does."""
        rewards = rewards or RewardConfig()
        base = self.verify_score(case, completion, rewards.format_bonus)
        if base >= 1.0:
            return rewards.correct_reward
        return rewards.incorrect_reward + base

    def reference_completion(self, case: Case) -> str:
        """The short ideal completion (used to warm-start a tiny policy by SFT)."""
        return f"<answer>{case.answer}</answer>"

    def identity(self, case: Case) -> str:
        """What makes two cases the same problem, for train/eval splits: the normalized prompt by default.

        Families whose problem has order-free parameters (gcd operands, a list to sort) override this, so that
        `gcd(12,18)` and `gcd(18,12)` count as one problem and cannot sit on both sides of a split.
        """
        return normalize_prompt(case.prompt)


def normalize_prompt(prompt: str) -> str:
    """Lower case, the answer-format sentence dropped, runs of whitespace made one space."""
    text = " ".join(prompt.lower().split())
    return " ".join(text.replace(" ".join(ANSWER_FORMAT.lower().split()), " ").split())


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def check_int(expected: str, given: str) -> bool:
    """Integer equality that tolerates spaces, a trailing period and `x = 5` style answers."""
    given = given.strip().rstrip(".")
    if "=" in given:
        given = given.rsplit("=", 1)[1]
    return int(given.replace(" ", "").replace(",", "")) == int(expected)


def check_int_list(expected: str, given: str) -> bool:
    """Ordered list of integers, separated by commas and/or spaces, brackets allowed."""
    cleaned = given.strip().strip("[]().").replace(",", " ")
    return [int(x) for x in cleaned.split()] == [int(x) for x in expected.split(",")]
