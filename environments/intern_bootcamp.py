"""InternBootcamp: procedurally generated, verifiable reasoning tasks (no dataset download).

Items come from `environments.bootcamp_tasks`: a weighted `RandomTask` mix of
task families (or one family by name) at the configured difficulty levels.
Rewards follow Atropos's InternBootcamp env: `correct_reward` for a correct
answer, `incorrect_reward + format_bonus` for a formatted but wrong one,
`incorrect_reward` when there is no `<answer>` tag.

    python environments/intern_bootcamp.py process --env.group_size 8 \
        --openai.base_url http://127.0.0.1:30000 --config deployments/intern_bootcamp.yaml
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, field_validator

from environments.base import EVAL_INDEX_OFFSET, BaseEnv, EnvConfig, Item
from environments.bootcamp_tasks import (
    FAMILIES,
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Case,
    RandomTask,
    RewardConfig,
    get_family,
)
from environments.bootcamp_tasks.split import ContentSplit


class InternBootcampConfig(EnvConfig):
    """The `env.` section for InternBootcamp."""

    task_name: str = Field("RandomTask", description="'RandomTask' for the weighted mix, or one family name.")
    weights: dict[str, float] | None = Field(None, description="Per-family weights for RandomTask; None weighs all equally.")
    difficulties: list[int] = Field([1], description="Difficulty levels (1-5) items are drawn from.")
    correct_reward: float = Field(1.0, description="Reward for a correct answer.")
    incorrect_reward: float = Field(-0.5, description="Reward for a wrong or missing answer.")
    format_bonus: float = Field(0.2, ge=0.0, lt=1.0, description="Added to incorrect_reward when the answer is tagged but wrong.")
    split: Literal["all", "train", "eval"] = Field(
        "all", description="Which side of the content split items come from: 'train' never yields a problem (same "
                           "normalized prompt or parameters) that 'eval' can; 'all' ignores the split.")
    eval_share: float = Field(0.25, gt=0.0, lt=1.0, description="Share of each family's problems on the eval side.")
    split_salt: str = Field("v1", description="Salt of the split's hash; another salt is another split.")

    @field_validator("task_name")
    @classmethod
    def _known_task(cls, value: str) -> str:
        if value != "RandomTask" and value not in FAMILIES:
            raise ValueError(f"unknown task {value!r}; use 'RandomTask' or one of: {', '.join(sorted(FAMILIES))}")
        return value

    @field_validator("difficulties")
    @classmethod
    def _levels(cls, value: list[int]) -> list[int]:
        if not value or any(not MIN_DIFFICULTY <= level <= MAX_DIFFICULTY for level in value):
            raise ValueError(f"difficulties {value} must be a non-empty list of levels {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        return value

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        unknown = sorted(set(value or {}) - set(FAMILIES))
        if unknown:
            raise ValueError(f"weights name unknown families {unknown}; known: {', '.join(sorted(FAMILIES))}")
        return value


class InternBootcampEnv(BaseEnv):
    name = "intern_bootcamp"
    config_cls = InternBootcampConfig
    scoring = "inline"  # regex + comparisons: microseconds, bounded; scorer processes would only add IPC
    config: InternBootcampConfig

    def __init__(self, config: InternBootcampConfig | None = None) -> None:
        super().__init__(config)
        weights = {self.config.task_name: 1.0} if self.config.task_name != "RandomTask" else self.config.weights
        self.tasks = RandomTask(weights, self.config.difficulties)
        self.content_split = ContentSplit(self.config.eval_share, self.config.split_salt)
        self.rewards = RewardConfig(
            correct_reward=self.config.correct_reward,
            incorrect_reward=self.config.incorrect_reward,
            format_bonus=self.config.format_bonus,
        )

    def get_item(self, index: int) -> Item:
        return self._drawn(index, self.config.split)

    def get_eval_item(self, index: int) -> Item:
        """With a split, eval items come from the eval side only (with 'all', from a far index range)."""
        return self._drawn(EVAL_INDEX_OFFSET + index, "all" if self.config.split == "all" else "eval")

    def _drawn(self, index: int, side: str) -> Item:
        rng = random.Random(f"{self.config.seed}:{index}")
        if side == "all":
            return self._item(index, self.tasks.generate(rng))
        family = rng.choices(self.tasks.names, weights=self.tasks.weights)[0]  # drawn as RandomTask.generate does
        return self._item(index, self.content_split.draw(rng, family, rng.choice(self.tasks.difficulties), side))

    def _item(self, index: int, case: Case) -> Item:
        info = {"index": index, "family": case.family, "difficulty": case.difficulty}
        return Item(key=case.key, messages=self.chat(case.prompt), answer=case, info=info)

    # --- the difficulty knob the curriculum moves ---
    def curriculum_families(self) -> list[str]:
        return list(self.tasks.names)

    def difficulty_range(self) -> tuple[int, int]:
        return (MIN_DIFFICULTY, MAX_DIFFICULTY)

    def base_weights(self) -> dict[str, float]:
        return dict(zip(self.tasks.names, self.tasks.weights))

    def get_planned_item(self, index: int, plan: dict) -> Item:
        """Family drawn by the plan's weights, at the plan's level for that family (seeded by seed and index)."""
        rng = random.Random(f"{self.config.seed}:{index}")
        weights = plan.get("weights") or {}
        names = self.tasks.names
        family = rng.choices(names, weights=[float(weights.get(n, w)) for n, w in zip(names, self.tasks.weights)])[0]
        static_level = rng.choice(self.tasks.difficulties)  # drawn as get_item does, so equal plans give equal items
        level = int((plan.get("levels") or {}).get(family, static_level))
        if self.config.split == "all":
            return self._item(index, get_family(family).generate(rng, level))
        return self._item(index, self.content_split.draw(rng, family, level, self.config.split))

    def solved(self, item: Item, score: float) -> bool:
        return score >= self.config.correct_reward

    def score(self, item: Item, completion: str) -> float:
        case: Case = item.answer
        return get_family(case.family).score(case, completion, self.rewards)

    def is_correct(self, item: Item, completion: str) -> bool:
        case: Case = item.answer
        return get_family(case.family).verify_score(case, completion) >= 1.0

    def eval_metrics(self, items: list[Item], completions: list[str]) -> dict[str, float]:
        metrics = super().eval_metrics(items, completions)
        for family in sorted({i.answer.family for i in items}):
            pairs = [(i, c) for i, c in zip(items, completions) if i.answer.family == family]
            metrics[f"accuracy/{family}"] = sum(self.is_correct(i, c) for i, c in pairs) / len(pairs)
        return metrics


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.intern_bootcamp:InternBootcampEnv"))
