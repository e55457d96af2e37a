"""Held-out accuracy of a policy directory on an environment's eval items, sampled by the serving engine in-process.

The same sampling settings before and after training (temperature, max tokens, one fixed seed per item), so a
change in accuracy is the policy's. Reports n and the binomial standard error.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from environments.base import BaseEnv


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


def heldout_accuracy(model_dir: str | Path, env: BaseEnv, *, n: int, temperature: float = 1.0, max_tokens: int = 24,
                     batch_rows: int = 64, seed: int = 0) -> EvalResult:
    """Sample one completion per eval item (item i gets sampling seed seed+i) and verify it."""
    import time

    from factory.inference.engine import GenRequest, PolicyEngine

    started = time.perf_counter()
    engine = PolicyEngine(model_dir)
    items = [env.get_eval_item(i) for i in range(n)]
    correct = 0
    families: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for start in range(0, n, batch_rows):
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
    return EvalResult(n, correct, {k: (v[0], v[1]) for k, v in sorted(families.items())},
                      time.perf_counter() - started)
