"""MATH: competition problems (file named math_env.py: as a script, math.py would shadow the standard library); the last \\boxed{} answer is checked with math-verify, equivalent forms accepted.

Rows come from `datasets.load_dataset`: a hub dataset (`env.dataset_name`, default `HuggingFaceH4/MATH-500`,
fields `problem`, `solution`, `answer`, `subject`, `level`) or, with `env.data_file`, a local JSONL of the same
fields loaded through `datasets`' json builder (the project ships its own 24 problems at
`environments/data/math_sample.jsonl`: what tests and the offline deployment use). The gold answer is the
`answer` field, else the last \\boxed{} of `solution`. math-verify accepts equivalent forms: 1/2 = 0.5 =
\\dfrac12, \\sqrt{8} = 2\\sqrt{2}, intervals and sets, units and degrees (`5\\text{ cm}` = 5). Reward 1.0 for an
equivalent boxed answer after any thinking, 0.0 for a wrong one or none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.base import Item
from environments.dataset_env import DatasetConfig, DatasetEnv

logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are enforced by tasks/score.py

SAMPLE_FILE = Path(__file__).parent / "data" / "math_sample.jsonl"
SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
_BOXED = "\\boxed{"


class MathConfig(DatasetConfig):
    """The `env.` section for MATH."""

    dataset_name: str = Field("HuggingFaceH4/MATH-500", description="Hub dataset loaded with datasets.load_dataset.")
    split: str = Field("test", description="Split training items come from.")
    data_file: str | None = Field(None, description="Local JSONL (problem, solution/answer, subject, level) instead.")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message put before every problem.")
    max_tokens: int = Field(512, ge=1, description="Most new tokens per completion.")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def gold_answer(row: dict[str, Any]) -> str:
    if row.get("answer"):
        return str(row["answer"])
    boxed = last_boxed(str(row.get("solution", "")))
    if boxed is None:
        raise ValueError(f"MATH row {str(row.get('problem', ''))[:60]!r} has no 'answer' and no \\boxed{{}} in its solution")
    return boxed


def equivalent(gold: str, answer: str) -> bool:
    """math-verify's equivalence of two LaTeX answers (no signal-based timeouts: we may run in threads)."""
    from math_verify import parse, verify

    mine = parse(f"${answer}$", parsing_timeout=None)
    return bool(mine) and bool(verify(parse(f"${gold}$", parsing_timeout=None), mine, timeout_seconds=None))


class MathEnv(DatasetEnv):
    name = "math"
    key_prefix = "math"
    config_cls = MathConfig
    config: MathConfig

    def _item(self, row: dict[str, Any], key: str) -> Item:
        info = {"subject": row.get("subject") or row.get("type") or "unknown", "level": str(row.get("level", ""))}
        return Item(key=key, messages=self.chat(row["problem"]), answer=gold_answer(row), info=info)

    def score(self, item: Item, completion: str) -> float:
        answer = last_boxed(completion.rsplit("</think>", 1)[-1])
        return 1.0 if answer is not None and equivalent(item.answer, answer) else 0.0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.math_env:MathEnv"))
