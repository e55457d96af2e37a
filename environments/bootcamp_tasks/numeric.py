"""Number task families: arithmetic, linear equations, sorting, maxima, gcd, remainders and base conversion."""

from __future__ import annotations

import math
import random
import re

from environments.bootcamp_tasks.base import Case, TaskFamily, check_int, check_int_list, normalize_prompt


def _unordered(case: Case) -> str:
    """The problem's numbers as a sorted multiset: order in the prompt does not make a new problem."""
    return ",".join(sorted(re.findall(r"\d+", case.prompt.split("Put the answer")[0]), key=int))


def _digits(rng: random.Random, n: int) -> int:
    return rng.randint(10 ** (n - 1), 10**n - 1) if n > 1 else rng.randint(1, 9)


_SIGNED_PRODUCT = re.compile(r"([+-]?)([^+-]+)")


def _value(expr: str) -> int:
    """An expression of non-negative integers joined by + - * (products first), as Python evaluates it: without
    eval's compile, ~4.5 us of an item's ~22 (issue 33)."""
    total = 0
    for sign, product in _SIGNED_PRODUCT.findall(expr):
        value = 1
        for factor in product.split("*"):
            value *= int(factor)
        total += -value if sign == "-" else value
    return total


class Arithmetic(TaskFamily):
    name = "arithmetic"
    description = "Integer expressions: 2-digit sums at level 1, mixed operations with precedence later."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        if difficulty == 1:  # the lowest level (the bench's): the sum straight from its terms
            a, b = _digits(rng, 2), _digits(rng, 2)
            return f"Compute {a}+{b}.", str(a + b)
        if difficulty == 2:
            a, b = _digits(rng, 3), _digits(rng, 2)
            expr = f"{a}{rng.choice('+-')}{b}"
        elif difficulty == 3:
            expr = f"{_digits(rng, 2)}*{_digits(rng, 1)}{rng.choice('+-')}{_digits(rng, 2)}"
        else:
            terms = [str(_digits(rng, difficulty - 2)) for _ in range(difficulty)]
            ops = [rng.choice("+-*") for _ in range(difficulty - 1)]
            expr = terms[0] + "".join(op + t for op, t in zip(ops, terms[1:]))
        return f"Compute {expr}.", str(_value(expr))

    def identity(self, case: Case) -> str:
        # a+b is b+a: a level-1 sum is its unordered pair of terms
        return f"sum {_unordered(case)}" if case.difficulty == 1 else normalize_prompt(case.prompt)

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class LinearEquation(TaskFamily):
    name = "linear_equation"
    description = "Solve a*x + b = c for an integer x."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        span = 5 * difficulty
        x = rng.randint(-span, span) if difficulty > 1 else rng.randint(1, 9)
        a = rng.randint(2, 2 + 2 * difficulty) * (rng.choice([1, -1]) if difficulty > 2 else 1)
        b = rng.randint(1, 10 * difficulty)
        return f"Solve {a}x+{b}={a * x + b}. x=?", str(x)

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class Sorting(TaskFamily):
    name = "sorting"
    description = ("Sort integers ascending; answer comma-separated. One knob per level: 3 then 4 digits, then 4 "
                   "two-digit numbers, then 5 and 6 three-digit numbers.")
    # (count, largest value) per level: each level changes one thing, so the next level is a step, not a cliff
    # (level 2 used to add a number and two-digit values at once: 0.00 for a policy at 0.5 on level 1).
    LADDER = {1: (3, 9), 2: (4, 9), 3: (4, 99), 4: (5, 999), 5: (6, 999)}

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        count, top = self.LADDER[difficulty]
        values = [rng.randint(0, top) for _ in range(count)]
        shown = ",".join(map(str, values))
        return f"Sort ascending: {shown}.", ",".join(map(str, sorted(values)))

    def identity(self, case: Case) -> str:
        return f"sort {_unordered(case)}"

    def check(self, expected: str, given: str) -> bool:
        return check_int_list(expected, given)


class ListMax(TaskFamily):
    name = "list_max"
    description = "The largest number in a short list."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        values = rng.sample(range(0, 10 ** min(difficulty + 1, 4)), 2 + difficulty)
        return f"Largest of {','.join(map(str, values))}?", str(max(values))

    def identity(self, case: Case) -> str:
        return f"max {_unordered(case)}"

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class Gcd(TaskFamily):
    name = "gcd"
    description = "Greatest common divisor of two numbers."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        factor = rng.randint(2, 3 + 3 * difficulty)
        a, b = factor * rng.randint(1, 5 * difficulty), factor * rng.randint(1, 5 * difficulty)
        return f"gcd({a},{b})=?", str(math.gcd(a, b))

    def identity(self, case: Case) -> str:
        return f"gcd {_unordered(case)}"

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class Modulo(TaskFamily):
    name = "modulo"
    description = "Remainder of a division."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        a, m = rng.randint(10, 10 ** (difficulty + 1)), rng.randint(2, 3 + 2 * difficulty)
        return f"{a} mod {m}=?", str(a % m)

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


class BaseConversion(TaskFamily):
    name = "base_conversion"
    description = "Decimal to binary (levels 1-2), then to octal or hex, then back to decimal."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        value = rng.randint(1, 2 ** (2 + 2 * difficulty))
        if difficulty <= 2:
            return f"{value} in binary?", format(value, "b")
        if difficulty == 3:
            base, digits = rng.choice([(8, format(value, "o")), (16, format(value, "x"))])
            return f"{value} in base {base}?", digits
        base = rng.choice([2, 8, 16])
        shown = format(value, {2: "b", 8: "o", 16: "x"}[base])
        return f"{shown} (base {base}) in decimal?", str(value)

    def check(self, expected: str, given: str) -> bool:
        strip = given.strip().lower().removeprefix("0b").removeprefix("0o").removeprefix("0x")
        return strip.lstrip("0") == expected.lower().lstrip("0") and bool(strip)


FAMILIES = (Arithmetic(), LinearEquation(), Sorting(), ListMax(), Gcd(), Modulo(), BaseConversion())
