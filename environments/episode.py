"""One multi-turn rollout: the conversation, and the tokens of the whole sequence with the model's turns marked.

A multi-turn environment (`BaseEnv.multi_turn = True`) implements
`play(item, episode)`: it calls `await episode.model_turn()` for each of the
model's turns and `episode.add(...)` for what the environment says in
between (tool results, a dealer's card, a user's follow-up). The episode keeps
the sequence as the model saw it, token for token:

    prompt ids | model turn 1 | env ids | model turn 2 | env ids | ... | model turn k

Model turns are the server's own output ids and logprobs (trained: their
mask is the token id); env ids are the chat template's text between the end
of one model turn and the start of the next (closing tag, the new messages,
the next generation prompt), tokenized with the policy's tokenizer (masked:
-100). With `/generate` (token in / token out) the next turn is sampled from
exactly these ids, so what the trainer sees is what the model saw; in `chat`
mode the server templates the messages itself and the ids are our rendering.
"""

from __future__ import annotations

from typing import Any

from environments.base import text_messages
from factory.inference.types import Completion, SamplingParams


def render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(text_messages(messages), add_generation_prompt=generation_prompt, tokenize=False)
    return text if isinstance(text, str) else str(text)


def env_turn_ids(tokenizer: Any, before: list[dict[str, Any]], new: list[dict[str, Any]], *, model_closed: bool) -> list[int]:
    """Token ids the template puts after the model's last turn (`before[-1]`) up to the next generation prompt.

    `model_closed`: the model's output already ended with the end-of-turn token (finish_reason "stop" on EOS),
    so the template's closing tag is not added a second time.
    """
    opened = render(tokenizer, before[:-1], generation_prompt=True) + str(before[-1]["content"])
    closed = render(tokenizer, before, generation_prompt=False)
    after = render(tokenizer, [*before, *new], generation_prompt=True)
    if not closed.startswith(opened) or not after.startswith(closed):
        raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                         "multi-turn token tracking needs a prefix-stable template (ChatML-style)")
    footer = closed[len(opened):]
    eos = tokenizer.eos_token or ""
    if model_closed and eos and footer.startswith(eos):
        footer = footer[len(eos):]
    return list(tokenizer.encode(footer + after[len(closed):], add_special_tokens=False))


class Episode:
    """The state of one multi-turn rollout; `BaseEnv.run_episode` makes one and turns it into a `Rollout`."""

    def __init__(self, item: Any, sampler: Any, sampling: SamplingParams, *, max_token_length: int | None = None) -> None:
        self.item = item
        self.sampler = sampler
        self.sampling = sampling
        self.tokenizer = getattr(sampler, "tokenizer", None)
        self.max_token_length = max_token_length
        self.messages: list[dict[str, Any]] = [dict(m) for m in item.messages]
        self.info: dict[str, Any] = {}
        """Anything the environment wants to remember about the episode (kept on the rollout, not stored)."""
        self.turns = 0
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_mask: list[bool] = []
        self.tokens_known = True
        self.logprobs_known = True
        self.finish_reason = "stop"
        self.policy_version: int | None = None
        self.endpoint = ""
        self._pending: list[dict[str, Any]] = []

    @property
    def length(self) -> int:
        return len(self.prompt_ids or []) + len(self.output_ids)

    def out_of_room(self, env_tokens: int = 128, reply_tokens: int | None = None) -> bool:
        """True when another env turn (about `env_tokens`) and a model turn (`reply_tokens`, default the whole
        `max_tokens`) would not fit `max_token_length`. A model turn never runs past it: see `model_turn`."""
        needed = self.length + env_tokens + (self.sampling.max_tokens if reply_tokens is None else reply_tokens)
        return self.max_token_length is not None and needed > self.max_token_length

    def add(self, *messages: dict[str, Any]) -> None:
        """Messages from the environment (role user/tool/system); they become masked tokens before the next turn."""
        self.messages.extend(messages)
        self._pending.extend(messages)

    async def model_turn(self) -> str:
        """Sample the model's next turn for the conversation so far; returns its text (also appended as a message)."""
        ids = None
        if self.turns and self.tokens_known:
            if self.tokenizer is None:
                self.tokens_known = False
            else:
                before = self.messages[: len(self.messages) - len(self._pending)]
                env_ids = env_turn_ids(self.tokenizer, before, self._pending, model_closed=self._closed)
                self._extend(env_ids, [1.0] * len(env_ids), trained=False)
                ids = [*(self.prompt_ids or []), *self.output_ids]
        self._pending = []
        kwargs = {"prompt_ids": ids} if ids is not None else {}
        sampling = self.sampling
        if ids is not None and self.max_token_length is not None:  # a later turn gets at most the room that is left
            room = self.max_token_length - len(ids)
            if room < sampling.max_tokens:
                sampling = sampling.model_copy(update={"max_tokens": max(room, 1)})
        completion: Completion = (await self.sampler.complete(self.messages, n=1, sampling=sampling, **kwargs))[0]
        if self.turns == 0:
            self.prompt_ids = list(completion.prompt_token_ids or []) or None
        self._record(completion)
        self.messages.append({"role": "assistant", "content": completion.text})
        self.turns += 1
        return completion.text

    def _record(self, completion: Completion) -> None:
        out = completion.output_token_ids
        if out is None or self.prompt_ids is None:
            self.tokens_known = False
        elif self.tokens_known:
            logprobs = completion.output_logprobs
            if logprobs is None or len(logprobs) != len(out):
                self.logprobs_known, logprobs = False, [0.0] * len(out)
            self._extend(list(out), list(logprobs), trained=True)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._closed = bool(out) and eos is not None and out[-1] == eos
        self.finish_reason = completion.finish_reason
        version = completion.policy_version
        self.policy_version = version if self.policy_version is None else min(self.policy_version, version)
        self.endpoint = completion.endpoint

    def _extend(self, ids: list[int], logprobs: list[float], *, trained: bool) -> None:
        self.output_ids.extend(ids)
        self.output_logprobs.extend(logprobs)
        self.output_mask.extend([trained] * len(ids))
