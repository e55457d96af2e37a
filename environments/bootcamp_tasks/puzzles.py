"""Puzzle task families: date arithmetic, small logic grids, cryptarithms and graph shortest paths."""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import random
import re

from environments.bootcamp_tasks.base import TaskFamily, check_int

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


class DateArithmetic(TaskFamily):
    name = "date_arithmetic"
    description = "Add days to a date (ISO answer), or name the weekday of a shifted date."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        start = dt.date(2024, 1, 1) + dt.timedelta(days=rng.randint(0, 365 * 3))
        if difficulty == 1:
            start = start.replace(day=rng.randint(1, 15))
            days = rng.randint(1, 9)
        else:
            days = rng.randint(1, 40 * difficulty) * (rng.choice([1, -1]) if difficulty > 2 else 1)
        end = start + dt.timedelta(days=days)
        verb = f"{days} days after" if days >= 0 else f"{-days} days before"
        if difficulty >= 4 and rng.random() < 0.5:
            return f"{start.isoformat()} is a {WEEKDAYS[start.weekday()]}. Weekday {verb} it?", WEEKDAYS[end.weekday()]
        return f"Date {verb} {start.isoformat()}? (YYYY-MM-DD)", end.isoformat()

    def check(self, expected: str, given: str) -> bool:
        return given.strip().rstrip(".").lower() == expected.lower()


PEOPLE = ("Ann", "Bob", "Cy", "Dan", "Eve")
PETS = ("dog", "cat", "fish", "bird", "frog")


class LogicGrid(TaskFamily):
    name = "logic_grid"
    description = "People own distinct pets; clues pin down a unique assignment; name one owner."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        size = min(1 + (difficulty + 1) // 2, 5)
        people, pets = list(PEOPLE[:size]), rng.sample(PETS, size)
        truth = dict(zip(people, rng.sample(pets, size)))
        candidates = [dict(zip(people, perm)) for perm in itertools.permutations(pets)]
        facts = [(p, q, truth[p] == q) for p in people for q in pets]
        rng.shuffle(facts)
        clues: list[str] = []
        for person, pet, owns in facts:
            if len(candidates) == 1:
                break
            # Prefer negative clues: they keep the puzzle from being a lookup.
            if owns and difficulty > 1 and len(candidates) > 2 and rng.random() < 0.7:
                continue
            kept = [c for c in candidates if (c[person] == pet) == owns]
            if len(kept) < len(candidates):
                candidates = kept
                clues.append(f"{person} has the {pet}." if owns else f"{person} lacks the {pet}.")
        while len(candidates) > 1:  # fall back to positive clues if negatives ran out
            person = next(p for p in people if len({c[p] for c in candidates}) > 1)
            clues.append(f"{person} has the {truth[person]}.")
            candidates = [c for c in candidates if c[person] == truth[person]]
        target = rng.choice(pets)
        owner = next(p for p, q in truth.items() if q == target)
        return f"{', '.join(people)} own {', '.join(sorted(pets))} (one each). {' '.join(clues)} Who has the {target}?", owner

    def check(self, expected: str, given: str) -> bool:
        return given.strip().rstrip(".").lower() == expected.lower()


class Cryptarithm(TaskFamily):
    name = "cryptarithm"
    description = "Letters stand for distinct digits in a sum; find them (a single digit at level 1)."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        letters = "ABC"[: 1 + (difficulty - 1) // 2]
        width = 2 if difficulty <= 2 else 3
        for _ in range(1000):
            digits = dict(zip(letters, rng.sample(range(10), len(letters))))
            a = [rng.choice(letters + "0123456789") for _ in range(width)]
            b = [rng.choice(letters + "0123456789") for _ in range(width)]
            if not set(letters) <= set(a + b):
                continue
            pattern_a, pattern_b = "".join(a), "".join(b)
            if any(self._value(p[0], digits) == 0 for p in (pattern_a, pattern_b)):
                continue
            total = self._value(pattern_a, digits) + self._value(pattern_b, digits)
            solutions = self._solve(pattern_a, pattern_b, total, letters)
            if len(solutions) == 1:
                answer = ",".join(f"{k}={v}" for k, v in sorted(digits.items()))
                if len(letters) == 1:
                    answer = str(digits[letters])
                which = f"{letters}=?" if len(letters) == 1 else f"Distinct digits {','.join(letters)}? (as A=1,B=2)"
                return f"{pattern_a}+{pattern_b}={total}. {which}", answer
        raise RuntimeError(f"cryptarithm: no unique puzzle found for difficulty {difficulty}; this is a bug")

    @staticmethod
    def _value(pattern: str, digits: dict[str, int]) -> int:
        return int("".join(str(digits.get(c, c)) for c in pattern))

    def _solve(self, a: str, b: str, total: int, letters: str) -> list[dict[str, int]]:
        found = []
        for perm in itertools.permutations(range(10), len(letters)):
            digits = dict(zip(letters, perm))
            if any(self._value(p[0], digits) == 0 for p in (a, b)):
                continue
            if self._value(a, digits) + self._value(b, digits) == total:
                found.append(digits)
        return found

    def check(self, expected: str, given: str) -> bool:
        if "=" not in expected:
            return check_int(expected, given)
        pairs = dict(re.findall(r"([A-Za-z])\s*=\s*(\d)", given))
        return {k.upper(): v for k, v in pairs.items()} == dict(p.split("=") for p in expected.split(","))


class ShortestPath(TaskFamily):
    name = "shortest_path"
    description = "Length of the shortest path between two nodes of a small weighted undirected graph."

    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        nodes = "ABCDEFGH"[: 3 + difficulty]
        edges: dict[tuple[str, str], int] = {}
        order = rng.sample(nodes, len(nodes))
        for u, v in zip(order, order[1:]):  # a spanning path keeps the graph connected
            edges[tuple(sorted((u, v)))] = rng.randint(1, 9)
        for _ in range(difficulty):
            u, v = rng.sample(nodes, 2)
            edges.setdefault(tuple(sorted((u, v))), rng.randint(1, 9))
        source, target = rng.sample(nodes, 2)
        shown = " ".join(f"{u}{v}={w}" for (u, v), w in sorted(edges.items()))
        return f"Edges {shown}. Shortest {source} to {target}?", str(self._dijkstra(edges, source, target))

    @staticmethod
    def _dijkstra(edges: dict[tuple[str, str], int], source: str, target: str) -> int:
        graph: dict[str, list[tuple[str, int]]] = {}
        for (u, v), w in edges.items():
            graph.setdefault(u, []).append((v, w))
            graph.setdefault(v, []).append((u, w))
        best, queue = {source: 0}, [(0, source)]
        while queue:
            dist, node = heapq.heappop(queue)
            if node == target:
                return dist
            for nxt, w in graph[node]:
                if dist + w < best.get(nxt, 1 << 30):
                    best[nxt] = dist + w
                    heapq.heappush(queue, (dist + w, nxt))
        raise RuntimeError(f"shortest_path: {target} unreachable from {source}; the generator must keep graphs connected")

    def check(self, expected: str, given: str) -> bool:
        return check_int(expected, given)


FAMILIES = (DateArithmetic(), LogicGrid(), Cryptarithm(), ShortestPath())
