"""RLAIF: a second model (the judge) compares answers against a rubric, pairwise and in both orders.

Each item is a prompt with a rubric (and a reference answer, for `evaluate`); the project ships 8 at
`environments/data/judge_prompts.jsonl`. After the group is sampled, every completion is compared with
`opponents` others of its group (all of them when the group is small), each pair twice with A and B swapped
to cancel the judge's position bias: a completion's score is its mean result over those comparisons (win 1,
tie or split decision 0.5, loss 0). The judge is an OpenAI-compatible endpoint from an
`InferenceEndpointsBlock` (`env.judge_block`) or `env.judge` (an `openai`-style section); it must answer with
`<verdict>A</verdict>`, `B` or `tie`; the common other formats are read too (`[[A]]`/`[[C]]` as in MT-bench,
`Verdict: B`, `{"winner": "A"}`, `Answer A is better`, a bare `A`). A verdict that cannot be parsed, or a
failed request, is retried (`judge_retries`, at a small temperature so the retry can differ); when it still
fails, the item's rollouts get `error="judge_unparseable: ..."` (the judge answered without a verdict) or
`error="judge_error: ..."` (no answer), and the group is dropped and counted as `failed`. No comparison is ever
silently scored. `evaluate` compares each greedy answer with the reference, in both orders.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item, Rollout, Sampler
from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.types import SamplingParams

logger = logging.getLogger(__name__)

SAMPLE_FILE = Path(__file__).parent / "data" / "judge_prompts.jsonl"
_VERDICT = re.compile(r"<verdict>\s*(A|B|tie)\s*</verdict>", re.IGNORECASE)
JUDGE_PROMPT = (
    "You are a strict judge. Compare two answers to the question against the rubric.\n"
    "Question: {prompt}\nRubric: {rubric}\n\n[Answer A]\n{a}\n[/Answer A]\n\n[Answer B]\n{b}\n[/Answer B]\n\n"
    "Which answer satisfies the rubric better? Reply with <verdict>A</verdict>, <verdict>B</verdict> or "
    "<verdict>tie</verdict>."
)


class JudgeError(RuntimeError):
    """The judge gave no usable verdict after every retry; `reason` says which way it failed."""

    def __init__(self, message: str, reason: str = "judge_error") -> None:
        super().__init__(message)
        self.reason = reason
        """"judge_unparseable" (it answered, but no verdict could be read) or "judge_error" (no answer)."""


class LLMJudgeConfig(EnvConfig):
    """The `env.` section for the LLM judge."""

    data_file: str = Field(str(SAMPLE_FILE), description="JSONL of {prompt, rubric, reference}.")
    judge_block: str | None = Field(None, description="Name of an InferenceEndpointsBlock for the judge endpoint.")
    judge: InferenceConfig | None = Field(None, description="The judge endpoint inline (used without judge_block).")
    judge_retries: int = Field(2, ge=0, description="Extra tries per comparison when the verdict is unusable.")
    judge_max_tokens: int = Field(32, ge=1, description="Most tokens of a verdict.")
    opponents: int = Field(3, ge=1, description="Others each completion is compared with (both orders each).")
    max_tokens: int = Field(128, ge=1, description="Most new tokens per completion.")


_VERDICT_FORMS = [
    _VERDICT,                                                                     # <verdict>A</verdict>
    re.compile(r"\[\[\s*(A|B|C|tie)\s*\]\]", re.IGNORECASE),                # MT-bench: [[A]], [[B]], [[C]] = tie
    re.compile(r"""["']?(?:verdict|winner|better|choice)["']?\s*[:=]\s*["']?\s*(?:answer\s+)?(A|B|tie)\b""",
               re.IGNORECASE),                                                    # Verdict: A, {"winner": "B"}
    re.compile(r"\b(?:answer|response|assistant)\s+(A|B)\s+is\s+(?:better|the\s+winner|preferred)", re.IGNORECASE),
]
_BARE = re.compile(r"^\W*(?:answer\s+)?(A|B|tie)\W*$", re.IGNORECASE)           # the whole reply: "A", "**B**", "Tie."


def parse_verdict(text: str) -> str | None:
    """'A', 'B' or 'tie' from the judge's reply in any common format (see `_VERDICT_FORMS`), or None.

    The first format that matches wins, and within it the last match (a judge may quote the format first).
    """
    for form in _VERDICT_FORMS:
        found = form.findall(text)
        if found:
            value = found[-1].upper()
            return "tie" if value in ("TIE", "C") else value
    bare = _BARE.match(text.strip())
    if bare:
        value = bare.group(1).upper()
        return "tie" if value == "TIE" else value
    return None


def both_orders(first: str | None, second: str | None) -> float:
    """Result for the answer shown as A in `first` and as B in `second`: 1 win, 0.5 tie/split, 0 loss."""
    points = {"A": 1.0, "tie": 0.5, "B": 0.0}
    return (points[first] + (1.0 - points[second])) / 2  # type: ignore[index]


class Judge:
    """Asks the judge endpoint for verdicts, with retries; counts calls, retries and failures."""

    def __init__(self, client: Any, config: LLMJudgeConfig) -> None:
        self.client, self.config = client, config
        self.counts: Counter[str] = Counter()

    async def verdict(self, item: Item, a: str, b: str) -> str:
        prompt = JUDGE_PROMPT.format(prompt=item.info["prompt"], rubric=item.info["rubric"], a=a, b=b)
        problem, reason = "", "judge_error"
        for attempt in range(self.config.judge_retries + 1):
            self.counts["calls"] += 1
            self.counts["retries"] += attempt > 0
            sampling = SamplingParams(temperature=0.0 if attempt == 0 else 0.7, max_tokens=self.config.judge_max_tokens)
            try:
                [reply] = await self.client.chat([{"role": "user", "content": prompt}], n=1, sampling=sampling)
            except Exception as error:  # the client already retried transport errors
                problem, reason = f"{type(error).__name__}: {error}", "judge_error"
                continue
            found = parse_verdict(reply.text)
            if found is not None:
                return found
            problem, reason = f"no verdict in {reply.text[:80]!r}", "judge_unparseable"
            self.counts["unparseable"] += 1
        self.counts["failures"] += 1
        raise JudgeError(f"judge gave no verdict after {self.config.judge_retries + 1} tries ({problem})", reason)

    async def compare(self, item: Item, x: str, y: str) -> float:
        """x's result against y, judged twice with the order swapped."""
        results = await asyncio.gather(self.verdict(item, x, y), self.verdict(item, y, x), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return both_orders(*results)


class LLMJudgeEnv(BaseEnv):
    name = "llm_judge"
    config_cls = LLMJudgeConfig
    scoring = "inline"  # scores are set while collecting; nothing is left for the scorer
    config: LLMJudgeConfig

    def setup(self) -> None:
        path = Path(self.config.data_file)
        if not path.is_file():
            raise FileNotFoundError(f"env.data_file {path} does not exist; point it at a JSONL of prompt/rubric/reference")
        self.rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def get_item(self, index: int) -> Item:
        if not hasattr(self, "rows"):
            self.setup()
        row = self.rows[index % len(self.rows)]
        return Item(key=f"judge:{index % len(self.rows)}:{index // len(self.rows)}", messages=self.chat(row["prompt"]),
                    answer=row.get("reference"), info={"prompt": row["prompt"], "rubric": row["rubric"]})

    def judge_config(self) -> InferenceConfig:
        if self.config.judge_block:
            from blocks.inference import InferenceEndpointsBlock

            return InferenceEndpointsBlock.load(self.config.judge_block).inference_config()
        if self.config.judge is None:
            raise ValueError("the llm_judge env needs a judge endpoint: set env.judge_block or env.judge.base_url")
        return self.config.judge

    async def judge(self) -> Judge:
        """One judge client per event loop (the datagen sampling loop, or evaluate's)."""
        loop = asyncio.get_running_loop()
        cached = self.__dict__.get("_judge_opening")
        if cached is None or cached[0] is not loop:  # no await before this assignment: concurrent items share it
            cached = self.__dict__["_judge_opening"] = (loop, asyncio.ensure_future(self._open_judge()))
        judge = await cached[1]
        self.__dict__["_judge"] = (loop, judge)
        return judge

    async def _open_judge(self) -> Judge:
        return Judge(await InferenceClient(self.judge_config()).__aenter__(), self.config)

    async def collect_trajectories(self, item: Item, sampler: Sampler, sampling: SamplingParams | None = None,
                                   n: int | None = None) -> list[Rollout]:
        rollouts = await super().collect_trajectories(item, sampler, sampling, n)
        await self.judge_group(item, rollouts, await self.judge())
        return rollouts

    async def judge_group(self, item: Item, rollouts: list[Rollout], judge: Judge) -> None:
        """Score each rollout by its pairwise results in its group; a judge failure marks them all as failed."""
        if len(rollouts) < 2:
            for r in rollouts:
                r.error = "judge_error: pairwise judging needs group_size >= 2"
            return
        rng = random.Random(item.key)
        pairs = {tuple(sorted((i, j))) for i in range(len(rollouts))
                 for j in rng.sample([k for k in range(len(rollouts)) if k != i], min(self.config.opponents, len(rollouts) - 1))}
        results = await asyncio.gather(*(judge.compare(item, rollouts[i].text, rollouts[j].text)
                                         for i, j in sorted(pairs)), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            if not isinstance(failed, JudgeError):
                raise failed
            for r in rollouts:
                r.error = f"{failed.reason}: {failed}"[:300]
            logger.warning("item %s: %s", item.key, failed)
            return
        points: dict[int, list[float]] = {i: [] for i in range(len(rollouts))}
        for (i, j), result in zip(sorted(pairs), results):
            points[i].append(result)
            points[j].append(1.0 - result)
        for i, r in enumerate(rollouts):
            r.score = sum(points[i]) / len(points[i])

    def score(self, item: Item, completion: str) -> float:
        raise NotImplementedError("llm_judge scores while collecting (the judge is asynchronous); see judge_group")

    async def evaluate(self, sampler: Sampler) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Each greedy answer against the item's reference, in both orders; failures are counted, not scored."""
        items = [self.get_eval_item(i) for i in range(self.config.eval_items)]
        greedy = SamplingParams(temperature=0.0, max_tokens=self.config.max_tokens)
        judge = await self.judge()
        rollouts = await asyncio.gather(*(self.collect_base(i, sampler, greedy) for i in items))

        async def one(item: Item, text: str) -> float | None:
            try:
                return await judge.compare(item, text, item.answer or "")
            except JudgeError:
                return None

        results = await asyncio.gather(*(one(i, r.text) for i, r in zip(items, rollouts)))
        judged = [r for r in results if r is not None]
        samples = [{"item_key": i.key, "messages": i.messages, "completion": r.text, "answer": i.answer,
                    "score": s, "correct": s is not None and s > 0.5} for i, r, s in zip(items, rollouts, results)]
        metrics = {"win_rate_vs_reference": sum(judged) / len(judged) if judged else 0.0,
                   "judge_failures": float(len(results) - len(judged)), "items": float(len(items)),
                   **{f"judge_{k}": float(v) for k, v in judge.counts.items()}}
        return metrics, samples

    async def collect_base(self, item: Item, sampler: Sampler, sampling: SamplingParams) -> Rollout:
        return (await BaseEnv.collect_trajectories(self, item, sampler, sampling, 1))[0]


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.llm_judge:LLMJudgeEnv"))
