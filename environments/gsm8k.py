"""GSM8K: grade-school math word problems; the answer goes in \\boxed{} after <think>…</think>, checked by math-verify.

Real runs load `openai/gsm8k` (config `main`) through `datasets`; set
`env.data_file` to a JSONL of `{"question", "answer"}` rows in GSM8K's format
(`… #### 42`) to use local problems instead, e.g. the project's own sample at
`environments/data/gsm8k_sample.jsonl` (what tests and the offline quickstart use).
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item

logger = logging.getLogger(__name__)
# math-verify warns on every call that its signal timeout is off; we enforce timeouts in tasks/score.py.
logging.getLogger("math_verify").setLevel(logging.ERROR)

SAMPLE_FILE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
SYSTEM_PROMPT = (
    "Think step by step inside <think> </think> tags, then give the final answer as \\boxed{number}."
)
_BOXED = re.compile(r"\\boxed\{")


class GSM8KConfig(EnvConfig):
    """The `env.` section for GSM8K."""

    dataset_name: str = Field("openai/gsm8k", description="Hugging Face dataset id loaded with datasets.load_dataset.")
    dataset_config: str = Field("main", description="Dataset config name.")
    split: str = Field("train", description="Split that training items come from.")
    eval_split: str = Field("test", description="Split that `evaluate` items come from.")
    data_file: str | None = Field(None, description="Local JSONL of {question, answer} rows used instead of the hub dataset.")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message put before every question.")
    max_tokens: int = Field(512, ge=1, description="Most new tokens per completion.")


def gold_answer(answer_field: str) -> str:
    """The number after GSM8K's `####` marker, commas removed."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer {answer_field[-60:]!r} has no '#### <number>' marker")
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "")


def final_boxed(completion: str) -> str | None:
    """The text after `</think>` if it holds a \\boxed{} (else None): only answers after thinking count."""
    if "</think>" not in completion:
        return None
    tail = completion.rsplit("</think>", 1)[1]
    return tail if _BOXED.search(tail) else None


def math_equal(gold: str, completion_tail: str) -> bool:
    """Whether the boxed answer equals the gold number, by math-verify (no signal timeouts: we run in threads/pools)."""
    from math_verify import parse, verify

    parsed = parse(completion_tail, parsing_timeout=None)
    if not parsed:
        return False
    return bool(verify(parse(gold, parsing_timeout=None), parsed, timeout_seconds=None))


class GSM8KEnv(BaseEnv):
    name = "gsm8k"
    config_cls = GSM8KConfig
    config: GSM8KConfig

    def setup(self) -> None:
        self.rows = self._load(self.config.split)
        self.order = random.Random(self.config.seed).sample(range(len(self.rows)), len(self.rows))

    def _load(self, split: str) -> list[dict[str, str]]:
        if self.config.data_file:
            path = Path(self.config.data_file)
            if not path.is_file():
                raise FileNotFoundError(f"env.data_file {path} does not exist; point it at a JSONL of question/answer rows")
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            import datasets

            rows = list(datasets.load_dataset(self.config.dataset_name, self.config.dataset_config, split=split))
        if not rows:
            raise ValueError(f"GSM8K split {split!r} from {self.config.data_file or self.config.dataset_name} is empty")
        return rows

    def _item(self, rows: list[dict[str, str]], row: int, key: str) -> Item:
        record = rows[row]
        return Item(key=key, messages=self.chat(record["question"]), answer=gold_answer(record["answer"]), info={"row": row})

    def get_item(self, index: int) -> Item:
        if not hasattr(self, "rows"):
            self.setup()
        epoch, position = divmod(index, len(self.rows))
        row = self.order[position]
        return self._item(self.rows, row, f"{self.config.split}-{row}" + (f"-e{epoch}" if epoch else ""))

    def get_eval_item(self, index: int) -> Item:
        if not hasattr(self, "eval_rows"):
            self.eval_rows = self._load(self.config.eval_split)
        row = index % len(self.eval_rows)
        return self._item(self.eval_rows, row, f"{self.config.eval_split}-{row}")

    def score(self, item: Item, completion: str) -> float:
        tail = final_boxed(completion)
        return 1.0 if tail is not None and math_equal(item.answer, tail) else 0.0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.gsm8k:GSM8KEnv"))
