"""The environment contract, in the spirit of Atropos's `BaseEnv`: items, sampling a group, scoring, evaluation.

An environment is prompts and scoring only. It never sees Prefect, Dask or
Parquet: the datagen flow (flows/datagen.py) asks it for items by index, lets
it sample a group through a `Sampler`, scores the completions with its pure
`score`, and turns the result into `ScoredGroup`s. Items are addressed by index
so that a chunk of work (items `[k*c, (k+1)*c)`) is the same on every rerun,
which is what makes resume exact.

A new environment is one file::

    class Echo(BaseEnv):
        name = "echo"
        def get_item(self, index):
            word = WORDS[index % len(WORDS)]
            return Item(key=f"echo:{index}", messages=self.chat(f"Say {word}."), answer=word)
        def score(self, item, completion):
            return 1.0 if item.answer in completion else 0.0
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field

from factory.config import FactoryConfig
from factory.inference.types import Completion, SamplingParams

if TYPE_CHECKING:
    from environments.episode import Episode

logger = logging.getLogger(__name__)

EVAL_INDEX_OFFSET = 1_000_000_000
"""Eval items of generated envs are drawn from indices far from the training ones."""


class EnvConfig(FactoryConfig):
    """What every environment takes (the `env.` section of a config); envs subclass it."""

    group_size: int = Field(16, ge=1, description="Completions sampled per item (Atropos's group_size).")
    total_items: int = Field(1000, ge=1, description="Items (problems) a datagen run works through.")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per completion.")
    max_token_length: int = Field(2048, ge=2, description="Groups with a sequence (prompt + completion) longer than this are dropped.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass for training rollouts.")
    seed: int = Field(0, description="Seed that fixes which items a run sees; part of every group id.")
    system_prompt: str | None = Field(None, description="System message put before every prompt; None for none.")
    ensure_scores_are_not_same: bool = Field(True, description="Drop groups whose scores are all equal (no GRPO signal).")
    eval_items: int = Field(32, ge=1, description="Items the `evaluate` mode scores (greedy, one completion each).")
    tokenizer_name: str | None = Field(
        None, description="HF tokenizer (path or hub id) for the chat template; defaults to openai.model_name."
    )


@dataclass(frozen=True)
class Item:
    """One prompt: a stable key, the chat messages to send, and what scoring needs (picklable)."""

    key: str
    messages: list[dict[str, Any]]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """One sampled completion of an item, with the server's tokens and logprobs, and later its score."""

    item_key: str
    text: str
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    output_logprobs: list[float] | None
    finish_reason: str
    policy_version: int
    endpoint: str = ""
    score: float | None = None
    error: str | None = None
    messages: list[dict[str, Any]] | None = None
    """Multi-turn rollouts: the whole conversation (prompt included); None means prompt + one reply `text`."""
    output_mask: list[bool] | None = None
    """Multi-turn rollouts: per output token, True where the model produced it (trained), False for env turns."""

    def scoring_input(self) -> str | list[dict[str, Any]]:
        """What `BaseEnv.score` gets: the reply text, or the whole conversation of a multi-turn rollout."""
        return self.messages if self.messages is not None else self.text

    @classmethod
    def from_completion(cls, item: Item, completion: Completion) -> Rollout:
        # by position (item_key, text, prompt_token_ids, output_token_ids, output_logprobs, finish_reason,
        # policy_version, endpoint): keywords cost ~2x on 8 rollouts a group
        return cls(item.key, completion.text, completion.prompt_token_ids, completion.output_token_ids,
                   completion.output_logprobs, completion.finish_reason, completion.policy_version, completion.endpoint)


class Sampler(Protocol):
    """How an environment asks for completions; the datagen tasks supply one over the inference client."""

    async def complete(self, messages: list[dict[str, Any]], *, n: int, sampling: SamplingParams,
                       prompt_ids: list[int] | None = None) -> list[Completion]:
        """Completions of `messages`; multi-turn episodes also pass the exact `prompt_ids` to continue from."""
        ...


class BaseEnv:
    """Subclass, set `name` (and `config_cls`), implement `get_item` and `score`; override the rest as needed."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[EnvConfig]] = EnvConfig
    scoring: ClassVar[str] = "process"
    """Default score mode: "process" (scorer processes, per-item timeout) or "inline" for verifiers that are
    cheap and cannot run away (the datagen flow's `datagen.score_mode: auto` follows this)."""

    multi_turn: ClassVar[bool] = False
    """True for envs that implement `play` (several model turns per rollout); `score` then gets the whole
    conversation (a list of messages) instead of the reply text."""

    def __init__(self, config: EnvConfig | None = None) -> None:
        self.config = config if config is not None else self.config_cls()
        if not isinstance(self.config, self.config_cls):
            raise TypeError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(self.config).__name__}")
        self._cursor = 0

    # --- items ---
    def setup(self) -> None:
        """Load what items need (datasets, tables); called once before the first item."""

    def get_item(self, index: int) -> Item:
        """The item at `index`: the same index must give the same item on every run with the same config."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_item(index)")

    def get_next_item(self) -> Item:
        """The next item in order (Atropos's name); the datagen flow uses `get_item` for exact resume."""
        item = self.get_item(self._cursor)
        self._cursor += 1
        return item

    # --- difficulty knob (optional; factory/curriculum.py moves it) ---
    def curriculum_families(self) -> list[str]:
        """Families whose items have a difficulty level the curriculum may move; [] (the default) for none."""
        return []

    def difficulty_range(self) -> tuple[int, int]:
        """(lowest, highest) level of `curriculum_families`, and the level a curriculum starts at is the lowest."""
        return (1, 1)

    def get_planned_item(self, index: int, plan: dict[str, Any]) -> Item:
        """The item at `index` drawn with a curriculum plan {"levels": {family: level}, "weights": {family: w}}.

        Same index and plan -> same item. Envs without a difficulty knob ignore the plan.
        """
        return self.get_item(index)

    def solved(self, item: Item, score: float) -> bool:
        """Whether a rollout's score counts as a pass for the curriculum's pass rate (default: score > 0)."""
        return score > 0

    def get_eval_item(self, index: int) -> Item:
        """An item for `evaluate`; generated envs draw from a far index range, dataset envs from a test split."""
        return self.get_item(EVAL_INDEX_OFFSET + index)

    def chat(self, user: str) -> list[dict[str, Any]]:
        """Messages for one user turn, with the configured system prompt first."""
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    # --- sampling ---
    def sampling(self) -> SamplingParams:
        """The config's sampling settings, built once while they and the object stay as they are (a validated
        model per group cost a datagen worker ~1.5 us of its ~200 us per group, issue 33)."""
        config = self.config
        wanted = (config.temperature, config.top_p, config.max_tokens, None, None)
        params = self.__dict__.get("_sampling")
        if params is None or (params.temperature, params.top_p, params.max_tokens, params.stop, params.seed) != wanted:
            params = self._sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                                                     max_tokens=config.max_tokens)
        return params

    async def collect_trajectories(self, item: Item, sampler: Sampler, sampling: SamplingParams | None = None,
                                   n: int | None = None) -> list[Rollout]:
        """Sample a group for one item: one prompt with n = group_size, or group_size episodes of `play`."""
        n, sampling = n or self.config.group_size, sampling or self.sampling()
        if not self.multi_turn:
            completions = await sampler.complete(item.messages, n=n, sampling=sampling)
            return [Rollout.from_completion(item, c) for c in completions]
        import asyncio

        return list(await asyncio.gather(*(self.run_episode(item, sampler, sampling) for _ in range(n))))

    async def play(self, item: Item, episode: Episode) -> None:
        """Multi-turn envs: drive one episode (`await episode.model_turn()`, `episode.add(...)`) to its end."""
        raise NotImplementedError(f"{type(self).__name__} sets multi_turn = True and must implement play(item, episode)")

    async def run_episode(self, item: Item, sampler: Sampler, sampling: SamplingParams) -> Rollout:
        """One multi-turn rollout: `play` it, then keep the whole conversation and its token segments."""
        from environments.episode import Episode

        episode = Episode(item, sampler, sampling, max_token_length=self.config.max_token_length)
        await self.play(item, episode)
        known = episode.tokens_known and episode.turns > 0
        return Rollout(
            item_key=item.key,
            text=next((m["content"] for m in reversed(episode.messages) if m["role"] == "assistant"), ""),
            prompt_token_ids=episode.prompt_ids if known else None,
            output_token_ids=episode.output_ids if known else None,
            output_logprobs=episode.output_logprobs if known and episode.logprobs_known else None,
            finish_reason=episode.finish_reason,
            policy_version=episode.policy_version or 0,
            endpoint=episode.endpoint,
            messages=episode.messages,
            output_mask=episode.output_mask if known else None,
        )

    # --- scoring ---
    def score(self, item: Item, completion: str) -> float:
        """Reward of one completion; a pure function of item and text (it runs in scorer processes).

        Multi-turn envs get the whole conversation (list of messages) as `completion`."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(item, completion)")

    def is_correct(self, item: Item, completion: str) -> bool:
        """Whether a completion counts as solved, for evaluation metrics."""
        return self.score(item, completion) > 0

    def eval_metrics(self, items: list[Item], completions: list[str]) -> dict[str, float]:
        """Metrics over one greedy completion per eval item (accuracy and mean score by default)."""
        scores = [self.score(i, c) for i, c in zip(items, completions)]
        correct = [self.is_correct(i, c) for i, c in zip(items, completions)]
        n = max(len(items), 1)
        return {"accuracy": sum(correct) / n, "mean_score": sum(scores) / n, "items": float(len(items))}

    async def evaluate(self, sampler: Sampler) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Greedy-sample every eval item once; return (metrics, per-sample records)."""
        import asyncio

        items = [self.get_eval_item(i) for i in range(self.config.eval_items)]
        greedy = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=self.config.max_tokens)
        results = await asyncio.gather(*(self.collect_trajectories(i, sampler, greedy, n=1) for i in items))
        texts = [r[0].scoring_input() if r else "" for r in results]
        samples = [
            {"item_key": i.key, "messages": i.messages, "completion": t, "answer": _plain(i.answer),
             "score": self.score(i, t), "correct": self.is_correct(i, t)}
            for i, t in zip(items, texts)
        ]
        return self.eval_metrics(items, texts), samples


IMAGE_PLACEHOLDER = "<image>"


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with OpenAI-style content parts flattened to text (pictures become `<image>`), for text-only
    chat templates; messages whose content is already a string are returned as they are."""
    if all(isinstance(m.get("content"), str) for m in messages):
        return messages
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") if part.get("type") == "text" else IMAGE_PLACEHOLDER
                              for part in content)
        flat.append({**message, "content": content})
    return flat


def _plain(value: Any) -> Any:
    """A JSON-friendly view of an item's answer."""
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    return getattr(value, "__dict__", str(value))


@dataclass(frozen=True)
class EnvSpec:
    """How to rebuild an environment in any process: `module:Class` plus its config as a plain dict."""

    ref: str
    config: dict[str, Any]

    @functools.cached_property
    def config_key(self) -> str:
        """`config` as sorted JSON, made once per spec: `load_env` looks envs up by it once per item when scoring
        inline (a spec's config is not changed after the spec is made)."""
        return json.dumps(self.config, sort_keys=True, default=str)

    def env_class(self) -> type[BaseEnv]:
        module, _, name = self.ref.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(f"environment {self.ref!r} cannot be imported ({error}); use 'package.module:ClassName'") from None
        if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
            raise ValueError(f"{self.ref!r} is not a BaseEnv subclass")
        return cls

    def build(self) -> BaseEnv:
        cls = self.env_class()
        return cls(cls.config_cls.model_validate(self.config))


_envs: dict[tuple[str, str, bool], BaseEnv] = {}
_envs_lock = threading.Lock()


def load_env(spec: EnvSpec, *, setup: bool = True) -> BaseEnv:
    """The environment for `spec`, built (and set up) once per process and reused by every chunk."""
    key = (spec.ref, spec.config_key, setup)
    with _envs_lock:
        env = _envs.get(key)
        if env is None:
            env = spec.build()
            if setup:
                env.setup()
            _envs[key] = env
        return env
