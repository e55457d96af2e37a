"""Text task families: letter counting, reversing and other string transforms."""

from __future__ import annotations

import random

from environments.bootcamp_tasks.base import TaskFamily, check_int

# Short common words keep level-1 prompts within a tiny model's reach.
SHORT_WORDS = ("cat", "dog", "sun", "map", "red", "box", "cup", "pen", "hat", "bus", "egg", "fox", "owl", "jam")
# One letter longer than level 1: the step between 3-letter and 6-letter words that the ladders lacked.
MID_WORDS = ("fish", "milk", "lamp", "moon", "frog", "ship", "door", "king", "wolf", "leaf", "rock", "star", "bird", "tree")
WORDS = (
    "apple", "banana", "cherry", "garden", "pepper", "letter", "bottle", "rabbit", "summer", "coffee",
    "marble", "puzzle", "window", "yellow", "planet", "silver", "mirror", "butter", "kitten", "ladder",
)
LONG_WORDS = ("strawberry", "mississippi", "bookkeeper", "committee", "assessment", "parallelogram", "successful")


def _word(rng: random.Random, difficulty: int) -> str:
    pool = SHORT_WORDS if difficulty == 1 else WORDS if difficulty <= 3 else LONG_WORDS
    return rng.choice(pool)


def _ladder_word(rng: random.Random, difficulty: int) -> str:
    """Word length grows one step a level (3, 4, 5-6, then long words) for the families whose rule is per letter."""
    pool = {1: SHORT_WORDS, 2: MID_WORDS, 3: WORDS}.get(difficulty, LONG_WORDS)
    return rng.choice(pool)


class LetterCount(TaskFamily):
    name = "letter_count"
    description = "How often a letter occurs in a word."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        word = _word(rng, difficulty)
        letter = rng.choice(word) if difficulty < 3 or rng.random() < 0.8 else rng.choice("aeiou")
        return f"Count '{letter}' in '{word}'.", str(word.count(letter))

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class Reverse(TaskFamily):
    name = "reverse"
    description = "Reverse a word of 3, 4 or 6 letters (levels 1-3) or the order of words in a phrase (4-5)."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        if difficulty <= 3:
            word = _ladder_word(rng, difficulty)
            return f"Reverse '{word}'.", word[::-1]
        words = rng.sample(WORDS, difficulty - 1)
        return f"Reverse the word order: '{' '.join(words)}'.", " ".join(reversed(words))

    def check(self, expected: str, given: str) -> bool:
        return " ".join(given.strip().strip("'\"").lower().split()) == expected


class StringTransform(TaskFamily):
    name = "string_transform"
    description = ("Upper-casing or dropping vowels (3-letter words, then 4-letter), then also first letters and "
                   "a Caesar shift on longer words.")

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        # Level 2 keeps level 1's two operations on one-letter-longer words; new operations come at level 3.
        word = _ladder_word(rng, difficulty)
        op = rng.choice(["upper", "novowels"] if difficulty <= 2 else ["upper", "novowels", "initials", "caesar"])
        if op == "upper":
            return f"Uppercase '{word}'.", word.upper()
        if op == "novowels":
            return f"Remove vowels from '{word}'.", "".join(c for c in word if c not in "aeiou")
        if op == "initials":
            words = rng.sample(WORDS, difficulty)
            return f"First letters of '{' '.join(words)}'?", "".join(w[0] for w in words)
        shift = rng.randint(1, 3)
        shifted = "".join(chr((ord(c) - 97 + shift) % 26 + 97) for c in word)
        return f"Shift each letter of '{word}' forward by {shift}.", shifted

    def check(self, expected: str, given: str) -> bool:
        return given.strip().strip("'\"") == expected


FAMILIES = (LetterCount(), Reverse(), StringTransform())
