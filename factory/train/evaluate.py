"""Accuracy of a policy directory on a fixed list of eval items, sampled by the serving engine in-process.

The same sampling settings before and after training (temperature, max tokens, one fixed seed per item), so a
change in accuracy is the policy's. Each result carries n, correct, the binomial standard error and a 95%
Wilson interval (which stays inside [0, 1] and is not zero-width at 0 or n correct).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.base import BaseEnv, Item

Z95 = 1.959964


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) when n is 0."""
    if n <= 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class EvalResult:
    n: int
    correct: int
    per_family: dict[str, tuple[int, int]] = field(default_factory=dict)  # family -> (correct, n)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def stderr(self) -> float:
        p = self.accuracy
        return math.sqrt(p * (1 - p) / self.n) if self.n else 0.0

    @property
    def interval95(self) -> tuple[float, float]:
        return wilson_interval(self.correct, self.n)

    def subset(self, families: set[str]) -> EvalResult:
        """The result over some families only (e.g. the headline families)."""
        kept = {f: v for f, v in self.per_family.items() if f in families}
        return EvalResult(sum(n for _, n in kept.values()), sum(c for c, _ in kept.values()), kept, self.seconds)

    def as_dict(self) -> dict[str, Any]:
        low, high = self.interval95
        return {"accuracy": round(self.accuracy, 4), "correct": self.correct, "n": self.n,
                "ci95": [round(low, 4), round(high, 4)], "per_family": {k: list(v) for k, v in self.per_family.items()}}


def evaluate_items(model_dir: str | Path, env: BaseEnv, items: list[Item], *, temperature: float = 1.0,
                   max_tokens: int = 24, batch_rows: int = 64, seed: int = 0, engine: Any = None) -> EvalResult:
    """Sample one completion per item (item i gets sampling seed seed+i; temperature 0 is greedy) and verify it."""
    from factory.inference.engine import GenRequest, PolicyEngine

    started = time.perf_counter()
    engine = engine or PolicyEngine(model_dir)
    correct = 0
    families: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for start in range(0, len(items), batch_rows):
        chunk = items[start : start + batch_rows]
        requests = []
        for offset, item in enumerate(chunk):
            ids = engine.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
            requests.append(GenRequest(list(ids), max_new_tokens=max_tokens, temperature=temperature,
                                       seed=seed + start + offset))
        for item, result in zip(chunk, engine.generate_batch(requests)):
            ok = env.is_correct(item, result.text)
            correct += ok
            family = str((item.info or {}).get("family", "all"))
            families[family][0] += ok
            families[family][1] += 1
    return EvalResult(len(items), correct, {k: (v[0], v[1]) for k, v in sorted(families.items())},
                      time.perf_counter() - started)


def heldout_accuracy(model_dir: str | Path, env: BaseEnv, *, n: int, temperature: float = 1.0, max_tokens: int = 24,
                     batch_rows: int = 64, seed: int = 0) -> EvalResult:
    """`evaluate_items` on the env's first n eval items (`get_eval_item(i)`)."""
    items = [env.get_eval_item(i) for i in range(n)]
    return evaluate_items(model_dir, env, items, temperature=temperature, max_tokens=max_tokens,
                          batch_rows=batch_rows, seed=seed)
