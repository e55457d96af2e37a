"""Environments over rows of a `datasets` dataset: a hub dataset, or a local JSONL through `datasets`' json builder.

A subclass sets `key_prefix` and writes `_item(row, key)`; training items walk a seeded shuffle of the split
(a second pass gets `-e1` keys, and so on), eval items walk `eval_split` in order, and `evaluate` reports
accuracy per `item.info["subject"]`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item


class DatasetConfig(EnvConfig):
    dataset_name: str = Field(..., description="Hub dataset loaded with datasets.load_dataset.")
    dataset_config: str | None = Field(None, description="Dataset config name, if the dataset has several.")
    split: str = Field("train", description="Split training items come from.")
    eval_split: str = Field("test", description="Split `evaluate` items come from.")
    data_file: str | None = Field(None, description="Local JSONL with the dataset's fields, used instead of the hub.")


class DatasetEnv(BaseEnv):
    key_prefix: str
    config: DatasetConfig

    def _item(self, row: dict[str, Any], key: str) -> Item:
        raise NotImplementedError  # abstract: each dataset env builds its own items

    def setup(self) -> None:
        self.rows = self._load(self.config.split)
        self.order = random.Random(self.config.seed).sample(range(len(self.rows)), len(self.rows))

    def _load(self, split: str) -> list[dict[str, Any]]:
        import datasets

        c = self.config
        if c.data_file:
            if not Path(c.data_file).is_file():
                raise FileNotFoundError(f"env.data_file {c.data_file} does not exist; point it at a JSONL of {self.name} rows")
            rows = list(datasets.load_dataset("json", data_files=c.data_file, split="train"))
        else:
            rows = list(datasets.load_dataset(c.dataset_name, c.dataset_config, split=split))
        if not rows:
            raise ValueError(f"{self.name}: split {split!r} of {c.data_file or c.dataset_name} is empty")
        return rows

    def get_item(self, index: int) -> Item:
        if not hasattr(self, "rows"):
            self.setup()
        epoch, position = divmod(index, len(self.rows))
        row = self.order[position]
        return self._item(self.rows[row], f"{self.key_prefix}-{self.config.split}-{row}" + (f"-e{epoch}" if epoch else ""))

    def get_eval_item(self, index: int) -> Item:
        if not hasattr(self, "eval_rows"):
            self.eval_rows = self._load(self.config.eval_split)
        row = index % len(self.eval_rows)
        return self._item(self.eval_rows[row], f"{self.key_prefix}-{self.config.eval_split}-{row}")

    def eval_metrics(self, items: list[Item], completions: list[str]) -> dict[str, float]:
        metrics = super().eval_metrics(items, completions)
        for subject in sorted({i.info["subject"] for i in items}):
            pairs = [(i, c) for i, c in zip(items, completions) if i.info["subject"] == subject]
            metrics[f"accuracy/{subject}"] = sum(self.is_correct(i, c) for i, c in pairs) / len(pairs)
        return metrics
