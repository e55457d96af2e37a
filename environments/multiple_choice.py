"""Multiple choice (MMLU-style): a question with lettered options; the letter is extracted robustly.

Rows come from `datasets.load_dataset`: `cais/mmlu` (config `all`; fields `question`, `choices`, `answer` as
an index, `subject`) or, with `env.data_file`, a local JSONL of the same fields (the project's own 16 questions
at `environments/data/mmlu_sample.jsonl`: what tests and the offline deployment use). The letter is taken
from, in order: `<answer>X</answer>`, `\\boxed{X}`, phrasings like "the answer is (C)", "Answer: C",
"correct option is C", "I choose C", then a reply that is only a letter ("C", "(C)", "C.", "C) text"), then
the text of exactly one option (3+ characters, whole words) named in the reply. Reward 1.0 for the right letter, 0 for a wrong one or
none; `evaluate` reports accuracy per subject.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.base import Item
from environments.dataset_env import DatasetConfig, DatasetEnv

SAMPLE_FILE = Path(__file__).parent / "data" / "mmlu_sample.jsonl"
LETTERS = "ABCDEFGHIJ"
SYSTEM_PROMPT = "Answer with the letter of the correct option, as <answer>X</answer>."

_L = r"\(?\s*([A-J])\s*\)?"
_PATTERNS = [
    re.compile(r"<answer>\s*" + _L + r"[^<]*</answer>", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*([A-J])\b", re.IGNORECASE),
    re.compile(r"answer\s*(?:is|:|would be|=)?\s*(?:option|choice|letter)?\s*:?\s*" + _L + r"(?![a-z])", re.IGNORECASE),
    re.compile(r"(?:option|choice)\s*(?:is\s*)?:?\s*" + _L + r"(?![a-z])", re.IGNORECASE),
    re.compile(r"\bI (?:choose|pick|select|go with)\s*(?:option\s*)?" + _L + r"(?![a-z])", re.IGNORECASE),
]
_ONLY_LETTER = re.compile(r"^\s*\(?([A-J])(?:[).:\]]|\s*$)", re.IGNORECASE)


class MultipleChoiceConfig(DatasetConfig):
    """The `env.` section for multiple choice."""

    dataset_name: str = Field("cais/mmlu", description="Hub dataset loaded with datasets.load_dataset.")
    dataset_config: str | None = Field("all", description="Dataset config (MMLU: 'all' or one subject).")
    split: str = Field("auxiliary_train", description="Split training items come from.")
    data_file: str | None = Field(None, description="Local JSONL of {question, choices, answer, subject} instead.")
    shuffle_choices: bool = Field(False, description="Shuffle the options per item (seeded), to fight letter bias.")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message put before every question.")
    max_tokens: int = Field(64, ge=1, description="Most new tokens per completion.")


def extract_letter(completion: str, choices: list[str]) -> str | None:
    """The chosen letter (upper case) among the first len(choices) letters, or None when there is none."""
    valid = LETTERS[: len(choices)]
    text = completion.rsplit("</think>", 1)[-1].replace("*", "")  # markdown bold is not part of an answer
    for pattern in _PATTERNS:
        found = [m.upper() for m in pattern.findall(text) if m.upper() in valid]
        if found:
            return found[-1]
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in (lines[-1:] + lines[:1]) if lines else []:
        match = _ONLY_LETTER.match(line)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    quoted = [LETTERS[i] for i, choice in enumerate(choices)  # whole words only; too-short options never count
              if len(choice.strip()) >= 3 and re.search(rf"\b{re.escape(choice.strip())}\b", text, re.IGNORECASE)]
    return quoted[0] if len(quoted) == 1 else None


def format_question(question: str, choices: list[str]) -> str:
    options = "\n".join(f"{LETTERS[i]}. {choice}" for i, choice in enumerate(choices))
    return f"{question}\n{options}"


class MultipleChoiceEnv(DatasetEnv):
    name = "multiple_choice"
    key_prefix = "mc"
    config_cls = MultipleChoiceConfig
    scoring = "inline"  # a few regexes: bounded and cheap
    config: MultipleChoiceConfig

    def _item(self, row: dict[str, Any], key: str) -> Item:
        choices = list(row["choices"])
        answer = int(row["answer"]) if not isinstance(row["answer"], str) else LETTERS.index(row["answer"].upper())
        if self.config.shuffle_choices:
            order = random.Random(f"{self.config.seed}:{key}").sample(range(len(choices)), len(choices))
            choices, answer = [choices[i] for i in order], order.index(answer)
        return Item(key=key, messages=self.chat(format_question(row["question"], choices)), answer=LETTERS[answer],
                    info={"subject": row.get("subject") or "unknown", "choices": choices})

    def score(self, item: Item, completion: str) -> float:
        return 1.0 if extract_letter(completion, item.info["choices"]) == item.answer else 0.0

    def eval_metrics(self, items: list[Item], completions: list[str]) -> dict[str, float]:
        metrics = super().eval_metrics(items, completions)
        answered = [extract_letter(c, i.info["choices"]) is not None for i, c in zip(items, completions)]
        metrics["answered"] = sum(answered) / max(len(items), 1)
        return metrics


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.multiple_choice:MultipleChoiceEnv"))
