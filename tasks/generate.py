"""Generate: a chunk of items -> a group of rollouts per item, with many inference requests in flight.

Tokens travel with the text. In `generate` mode (SGLang's /generate, the
default for `server_type: sglang`) the chat template is applied here with the
policy's tokenizer and the server's output ids and logprobs are kept as they
are. In `chat` mode (OpenAI-compatible servers without /generate) the prompt
is templated and the completion tokenized locally when the server does not
return ids; logprobs are kept only when they line up with the tokens.
A failed item becomes rollouts with `error` set (a bad rollout is data); a
chunk where most items fail raises, so Prefect's retries handle a dead server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from environments.base import BaseEnv, EnvSpec, Item, Rollout, load_env, text_messages
from factory.datagen.heap import freeze_startup_heap
from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.health import EndpointsDown
from factory.inference.types import Completion, SamplingParams
from factory.slurm_cluster import resolve_node_local, worker_identity

logger = logging.getLogger(__name__)

SamplingApi = Literal["auto", "generate", "chat"]


_tokenizer_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot load tokenizer {name!r} ({error}); set env.tokenizer_name to the policy directory or hub id"
        ) from None


def load_tokenizer(name: str) -> Any:
    """The HF tokenizer (with chat template) of the policy, loaded once per process (transformers' lazy imports
    are not safe to race from several chunk threads)."""
    with _tokenizer_lock:
        return _load_tokenizer(name)


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of the chat prompt with the generation prompt opened, as the policy was trained to see it
    (content parts flattened: a text-only template sees `<image>` where a picture is).

    The same ids as `apply_chat_template(..., tokenize=True)`, which renders the template and then encodes the text
    with `add_special_tokens=False`: here the text is rendered and handed to `encode_texts`, which skips
    transformers' per-call Python (~70 -> ~54 us per prompt on the bench's tokenizer)."""
    text = tokenizer.apply_chat_template(text_messages(messages), add_generation_prompt=True, tokenize=False)
    return encode_texts(tokenizer, [text])[0]


class ClientSampler:
    """The `Sampler` environments use: token in/token out over /generate, or chat with local tokenization."""

    PROMPT_CACHE_MAX = 4096

    def __init__(self, client: InferenceClient, tokenizer: Any | None, api: Literal["generate", "chat"]) -> None:
        if api == "generate" and tokenizer is None:
            raise ValueError("sampling through /generate needs a tokenizer; set env.tokenizer_name")
        self.client, self.tokenizer, self.api = client, tokenizer, api
        self._prompt_cache: dict[str, list[int]] = {}
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._unprepared: list[Sequence[list[dict[str, Any]]]] = []
        if tokenizer is not None:
            serial_tokenizers()

    def prepare(self, conversations: Sequence[list[dict[str, Any]]]) -> None:
        """The prompts a chunk is about to sample: the first one that needs its token ids templates and encodes
        all of them in one call each (the per-call Python of `apply_chat_template` is paid once per chunk, not
        once per prompt). Nothing is done until then: a chat server that returns prompt ids never needs them."""
        if self.tokenizer is not None:
            self._unprepared.append(conversations)  # keyed when the first prompt's ids are needed

    def _ids(self, messages: list[dict[str, Any]]) -> list[int]:
        key = repr(messages)
        ids = self._prompt_cache.get(key)
        if ids is None and self._unprepared:
            for conversations in self._unprepared:
                for prepared in conversations:
                    prepared_key = repr(prepared)
                    if prepared_key not in self._prompt_cache:
                        self._pending[prepared_key] = prepared
            self._unprepared = []
        if ids is None and key in self._pending:
            self._template_pending()
            ids = self._prompt_cache.get(key)
        if ids is None:
            if len(self._prompt_cache) > self.PROMPT_CACHE_MAX:
                self._prompt_cache.clear()
            ids = self._prompt_cache[key] = prompt_ids(self.tokenizer, messages)
        return ids

    def _template_pending(self) -> None:
        """`prompt_ids` of every pending prompt, in one batched template call and one encode call. On any error
        nothing is cached: each prompt is then templated alone and fails (as an error rollout) as it would have."""
        pending, self._pending = self._pending, {}
        if len(self._prompt_cache) + len(pending) > self.PROMPT_CACHE_MAX:
            self._prompt_cache.clear()
        keys = list(pending)[: self.PROMPT_CACHE_MAX]
        try:
            texts = self.tokenizer.apply_chat_template([text_messages(pending[key]) for key in keys],
                                                       add_generation_prompt=True, tokenize=False)
            if not isinstance(texts, list) or len(texts) != len(keys):
                return
            self._prompt_cache.update(zip(keys, encode_texts(self.tokenizer, texts)))
        except Exception:  # noqa: BLE001 - see the docstring
            logger.debug("batched prompt templating failed; templating each prompt alone", exc_info=True)

    async def complete(self, messages: list[dict[str, Any]], *, n: int, sampling: SamplingParams,
                       prompt_ids: list[int] | None = None) -> list[Completion]:
        """Completions of `messages`; with /generate, `prompt_ids` (a multi-turn episode's exact sequence so far)
        is sent as it is instead of templating the messages."""
        if self.api == "generate":
            ids = list(prompt_ids) if prompt_ids is not None else self._ids(messages)
            completions = await self.client.generate(ids, n=n, sampling=sampling)
            return [c if c.prompt_token_ids else _with_tokens(c, ids, c.output_token_ids, c.output_logprobs)
                    for c in completions]
        completions = await self.client.chat(messages, n=n, sampling=sampling)
        if self.tokenizer is None:
            return completions
        return self._tokenize_all(messages, completions, prompt_ids)

    def _tokenize_all(self, messages: list[dict[str, Any]], completions: list[Completion],
                      prompt_ids: list[int] | None = None) -> list[Completion]:
        """Token ids for a group's completions: the server's where it returned them, else one batched encode of
        the rest (one tokenizer call per group, not one per completion); the prompt is templated once."""
        if all(c.prompt_token_ids and c.output_token_ids is not None
               and (c.output_logprobs is None or len(c.output_logprobs) == len(c.output_token_ids))
               for c in completions):
            return completions  # the server gave every id (and aligned logprobs): nothing to change
        missing = [c.text for c in completions if c.output_token_ids is None]
        encoded = iter(encode_texts(self.tokenizer, missing) if missing else [])
        prompt = None if all(c.prompt_token_ids for c in completions) else (prompt_ids or self._ids(messages))
        eos = self.tokenizer.eos_token_id
        tokenized = []
        for c in completions:
            output, logprobs = c.output_token_ids, c.output_logprobs
            if output is None:
                output = next(encoded)
                if c.finish_reason == "stop" and eos is not None:
                    output.append(eos)
            if logprobs is not None and len(logprobs) != len(output):
                logprobs = None  # server tokens and ours differ: better no logprobs than misaligned ones
            if output is c.output_token_ids and logprobs is c.output_logprobs and c.prompt_token_ids:
                tokenized.append(c)  # the server gave every id: nothing to change
            else:
                tokenized.append(_with_tokens(c, c.prompt_token_ids or prompt, output, logprobs))
        return tokenized


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)` for every text, in one call: straight to the Rust
    tokenizer's batch encode when the tokenizer is a fast one (the per-call Python of transformers' `encode` cost
    more than the encoding itself on short answers), else transformers' batch call.

    The Rust call is `encode_batch_fast` where the installed tokenizers has it (the same ids without character
    offsets, which nothing here reads). A backend with truncation or padding configured goes through transformers,
    which turns them off for `encode` as the direct call would not."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def serial_tokenizers() -> None:
    """Rust tokenizers encode one thread per call, unless TOKENIZERS_PARALLELISM is already set.

    A datagen worker encodes a group (a few short texts) at a time from its event loop: spreading each call over
    a thread pool cost ~1.4x the CPU of encoding in the calling thread (89-116 vs 64-80 us of process CPU per group
    of 8 answers, bench tokenizer), bought nothing a chunk's many concurrent requests need, and is what makes
    tokenizers warn and switch itself off when the worker later forks scorer processes."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _with_tokens(c: Completion, prompt: list[int] | None, output: list[int] | None,
                 logprobs: list[float] | None) -> Completion:
    """`c` with its token ids and logprobs set: `dataclasses.replace` without its per-call field walk (~8x
    cheaper; tests/unit/tasks/test_tokenize_same_as_before.py checks that these are all of Completion's fields)."""
    return Completion(c.text, prompt, output, logprobs, c.finish_reason, c.policy_version, c.endpoint)


class _SamplingLoop:
    """One event loop per process, on its own thread, shared by every chunk: clients and their connections live
    across chunks (opening a client per chunk costs ~0.4 s of TLS setup) and concurrent chunks share them."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coro: Any) -> Any:
        with cls._lock:
            if cls._loop is None or not cls._loop.is_running():
                loop = asyncio.new_event_loop()
                started = threading.Event()
                threading.Thread(target=cls._serve, args=(loop, started), name="sampling-loop", daemon=True).start()
                started.wait()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        loop.run_forever()


_clients: dict[str, asyncio.Future] = {}


async def _shared_client(config: InferenceConfig) -> InferenceClient:
    """The open client for `config` in the sampling loop, opened once (concurrent first callers share it)."""
    key = config.model_dump_json()
    opening = _clients.get(key)
    if opening is None or (opening.done() and opening.exception() is not None):
        opening = _clients[key] = asyncio.ensure_future(InferenceClient(config).__aenter__())
    return await opening


def resolve_api(api: SamplingApi, config: InferenceConfig) -> Literal["generate", "chat"]:
    if api != "auto":
        return api
    return "generate" if config.server_type == "sglang" else "chat"


class GeneratedChunk:
    """What generating one chunk produced: its items, a list of rollouts per item, and inference time.

    A plain class on purpose: Prefect walks dataclasses, lists and dicts passed between tasks looking for
    futures, which costs seconds on a chunk's worth of rollouts; it does not descend into other objects.
    """

    def __init__(self, items: list[Item], rollouts: list[list[Rollout]], failed_items: int, generate_s: float,
                 started_at: float = 0.0) -> None:
        self.items, self.rollouts, self.failed_items = items, rollouts, failed_items
        self.generate_s = generate_s
        self.started_at = started_at  # wall-clock start (time.time()), to measure the share of time in inference
        self.worker: dict[str, Any] = {}  # where it was generated: host, SLURM job id, pid (chunk stats)


async def generate_items(env: BaseEnv, items: Sequence[Item], sampler: Any, *, max_in_flight: int) -> GeneratedChunk:
    """Sample a group for every item, at most `max_in_flight` items at once; failures become error rollouts.

    `max_in_flight` workers take the items in order, each sampling one item at a time: a task and a semaphore wait
    per item (gather over every item behind a semaphore) cost the event loop ~6 us of a group's ~80 with 3000 items
    a chunk (none resolved with 375; issue 33), and kept a task per item alive."""
    started, wall = time.perf_counter(), time.time()
    if not env.multi_turn and (prepare := getattr(sampler, "prepare", None)) is not None:
        prepare([item.messages for item in items])  # one-reply items: their prompts are templated as a batch
    rollouts: list[list[Rollout]] = [[] for _ in items]
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for index in next_index:
            item = items[index]
            try:
                rollouts[index] = await env.collect_trajectories(item, sampler)
            except EndpointsDown:
                raise  # no endpoint left: the chunk (and the run) fails now, naming them
            except Exception as error:  # recorded as data; the chunk decides if it is an outage
                reason = f"generate_error: {type(error).__name__}: {error}"[:300]
                logger.warning("item %s failed: %s", item.key, reason)
                rollouts[index] = [Rollout(item.key, "", None, None, None, "abort", 0, error=reason)]

    await asyncio.gather(*(worker() for _ in range(min(max_in_flight, len(items)))))
    failed = 0
    for group in rollouts:  # plain loops: a generator per group cost ~1.5 us of a group's ~200 (issue 33)
        for rollout in group:
            if rollout.error is not None and rollout.error.startswith("generate_error"):
                failed += 1
                break
    return GeneratedChunk(list(items), rollouts, failed, time.perf_counter() - started, wall)


def generate_chunk(
    spec: EnvSpec,
    indices: Sequence[int],
    openai: InferenceConfig,
    *,
    tokenizer_name: str | None,
    api: SamplingApi = "auto",
    max_in_flight: int = 64,
    max_failed_fraction: float = 0.5,
    plan: dict[str, Any] | None = None,
) -> GeneratedChunk:
    """Items at `indices` (drawn with a curriculum `plan` if given) and their rollouts; raises when more than
    `max_failed_fraction` of items failed."""
    env = load_env(spec)
    items = [env.get_item(i) if plan is None else env.get_planned_item(i, plan) for i in indices]
    if (node_urls := resolve_node_local(openai.base_url)) != openai.base_url:
        openai = openai.model_copy(update={"base_url": node_urls})  # this SLURM worker's own node server
    chosen = resolve_api(api, openai)
    tokenizer = load_tokenizer(tokenizer_name) if tokenizer_name else None
    freeze_startup_heap()  # once per worker process: full collections skip the imports' heap

    async def run() -> GeneratedChunk:
        client = await _shared_client(openai)
        return await generate_items(env, items, ClientSampler(client, tokenizer, chosen), max_in_flight=max_in_flight)

    result = _SamplingLoop.run(run())
    result.worker = worker_identity()
    if items and result.failed_items / len(items) > max_failed_fraction:
        example = next(r.error for g in result.rollouts for r in g if r.error)
        raise RuntimeError(
            f"{result.failed_items} of {len(items)} items failed to generate (e.g. {example}); "
            f"check that openai.base_url {openai.base_url} is up"
        )
    return result
