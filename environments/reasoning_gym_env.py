"""reasoning-gym: 100+ procedural reasoning tasks with verifiers (the `reasoning-gym` package, fully offline).

One dataset by name (`env.dataset: basic_arithmetic`) or a weighted mix (`env.mix: {basic_arithmetic: 2,
word_sorting: 1}`). Difficulty is a knob an adaptive curriculum can turn: `env.level` sets every attribute of
a dataset's reasoning-gym curriculum to that level (datasets without a curriculum keep their defaults), and
`env.dataset_config` sets any of a dataset's own config fields (e.g. `{basic_arithmetic: {max_terms: 4}}`),
on top of the level. The answer goes in `<answer></answer>`; the reward is the dataset's own `score_answer`
(0..1, partial credit where the dataset gives it), 0 when there is no answer tag.

(The file is not called reasoning_gym.py: run as a script, it would shadow the package it imports.)
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field, model_validator

from environments.base import EVAL_INDEX_OFFSET, BaseEnv, EnvConfig, Item

SYSTEM_PROMPT = "Think briefly, then give only the final answer inside <answer></answer>."
DATASET_SIZE = 1_000_000  # items are generated per index; the size only bounds the index


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("the reasoning_gym env needs the reasoning-gym package: pip install reasoning-gym==0.1.25") from None
    return reasoning_gym


class ReasoningGymConfig(EnvConfig):
    """The `env.` section for reasoning-gym."""

    dataset: str = Field("basic_arithmetic", description="reasoning-gym dataset name (used when `mix` is empty).")
    mix: dict[str, float] | None = Field(None, description="Weighted mix of dataset names; overrides `dataset`.")
    level: int | None = Field(None, ge=0, description="Curriculum level for every attribute (None: dataset defaults).")
    dataset_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-dataset config fields (difficulty settings), applied after `level`.")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message put before every question.")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per completion.")

    @model_validator(mode="after")
    def _known_datasets(self) -> ReasoningGymConfig:
        from reasoning_gym.factory import DATASETS

        names = {self.dataset, *(self.mix or {}), *self.dataset_config}
        unknown = sorted(names - set(DATASETS))
        if unknown:
            raise ValueError(f"unknown reasoning-gym datasets {unknown}; e.g. {', '.join(sorted(DATASETS)[:8])}, ...")
        if self.mix is not None and (not self.mix or any(w < 0 for w in self.mix.values()) or not sum(self.mix.values())):
            raise ValueError(f"mix {self.mix} needs non-negative weights with a positive sum")
        return self


def extract(completion: str) -> str | None:
    """The last <answer> after any thinking, as reasoning-gym extracts it."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion.rsplit("</think>", 1)[-1])


class ReasoningGymEnv(BaseEnv):
    name = "reasoning_gym"
    config_cls = ReasoningGymConfig
    config: ReasoningGymConfig

    def setup(self) -> None:
        self.weights = self.config.mix or {self.config.dataset: 1.0}
        self.names = sorted(self.weights)
        self.datasets = {name: self._dataset(name, self.config.seed) for name in self.names}

    def dataset_settings(self, name: str) -> dict[str, Any]:
        """The dataset's config fields at the configured level, with `dataset_config` on top."""
        from reasoning_gym.factory import create_curriculum, has_curriculum

        settings: dict[str, Any] = {}
        if self.config.level is not None and has_curriculum(name):
            curriculum = create_curriculum(name)
            for attribute in curriculum.attributes:
                top = len(curriculum.attributes[attribute].levels) - 1
                curriculum.set_attr_level(attribute, min(self.config.level, top))
            generated = curriculum.generate_configuration({})
            settings = {k: v for k, v in vars(generated).items() if k not in ("seed", "size")}
        return {**settings, **self.config.dataset_config.get(name, {})}

    def _dataset(self, name: str, seed: int) -> Any:
        return _rg().create_dataset(name, seed=seed, size=DATASET_SIZE, **self.dataset_settings(name))

    def get_item(self, index: int) -> Item:
        if not hasattr(self, "datasets"):
            self.setup()
        rng = random.Random(f"{self.config.seed}:{index}")
        name = rng.choices(self.names, weights=[self.weights[n] for n in self.names])[0]
        if index >= EVAL_INDEX_OFFSET:  # eval items: the same datasets under another seed
            dataset, position = self._eval_dataset(name), index - EVAL_INDEX_OFFSET
        else:
            dataset, position = self.datasets[name], index
        entry = dataset[position % DATASET_SIZE]
        plain = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
        return Item(key=f"rg:{name}:{self.config.level}:{self.config.seed}:{index}", messages=self.chat(entry["question"]),
                    answer=plain, info={"dataset": name})

    def _eval_dataset(self, name: str) -> Any:
        cache = self.__dict__.setdefault("_eval", {})
        if name not in cache:
            cache[name] = self._dataset(name, self.config.seed + 7_919)
        return cache[name]

    def score(self, item: Item, completion: str) -> float:
        answer = extract(completion)
        if answer is None:
            return 0.0
        scorer = _rg().get_score_answer_fn(item.info["dataset"])
        return float(scorer(answer, item.answer))

    def is_correct(self, item: Item, completion: str) -> bool:
        return self.score(item, completion) >= 1.0

    def eval_metrics(self, items: list[Item], completions: list[str]) -> dict[str, float]:
        metrics = super().eval_metrics(items, completions)
        for name in sorted({i.info["dataset"] for i in items}):
            pairs = [(i, c) for i, c in zip(items, completions) if i.info["dataset"] == name]
            metrics[f"accuracy/{name}"] = sum(self.is_correct(i, c) for i, c in pairs) / len(pairs)
        return metrics


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.reasoning_gym_env:ReasoningGymEnv"))
