"""A chunk's prompts templated as one batch (issue 33): the same prompt ids as one `prompt_ids` call per prompt, on
the tiny and the starter tokenizers, and nothing templated until a prompt's ids are needed."""

from __future__ import annotations

import asyncio

import pytest

from environments.base import BaseEnv, Item, Rollout
from factory.inference.types import Completion, SamplingParams
from tasks.generate import ClientSampler, generate_items, prompt_ids
from tests.unit.tasks.test_tokenize_same_as_before import CONVERSATIONS as EDGE_CASES

# the edge cases of test_tokenize_same_as_before, a repeat, and enough plain prompts to make a batch
CONVERSATIONS = EDGE_CASES + [EDGE_CASES[0]] + [
    [{"role": "user", "content": f"Compute {a}*{a + 3}."}] for a in range(40)]


class CountingTokenizer:
    """The tokenizer, counting its `apply_chat_template` calls."""

    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_prepared_prompts_have_the_ids_of_one_call_per_prompt(tokenizer):
    counting = CountingTokenizer(tokenizer)
    sampler = ClientSampler(client=None, tokenizer=counting, api="chat")
    sampler.prepare(CONVERSATIONS)
    assert counting.calls == 0  # nothing until a prompt's ids are needed
    got = [sampler._ids(messages) for messages in CONVERSATIONS]
    assert counting.calls == 1  # the whole chunk in one call
    assert got == [prompt_ids(tokenizer, messages) for messages in CONVERSATIONS]


def test_prompts_beyond_the_cache_limit_are_templated_alone(tokenizer, monkeypatch):
    monkeypatch.setattr(ClientSampler, "PROMPT_CACHE_MAX", 5)
    sampler = ClientSampler(client=None, tokenizer=tokenizer, api="chat")
    sampler.prepare(CONVERSATIONS)
    assert [sampler._ids(messages) for messages in CONVERSATIONS] == [prompt_ids(tokenizer, m) for m in CONVERSATIONS]


def test_a_tokenizer_without_a_chat_template_fails_per_prompt_as_before(tiny):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tiny))
    plain.chat_template = None
    with pytest.raises(ValueError) as alone:
        prompt_ids(plain, CONVERSATIONS[0])
    sampler = ClientSampler(client=None, tokenizer=plain, api="chat")
    sampler.prepare(CONVERSATIONS[:3])
    for messages in CONVERSATIONS[:3]:  # every prompt still raises its own error (an error rollout per item)
        with pytest.raises(ValueError) as prepared:
            sampler._ids(messages)
        assert str(prepared.value) == str(alone.value)


def test_a_group_tokenized_after_prepare_is_as_without(tokenizer):
    completions = [Completion(f"<answer>{k}</answer>", None, None, None, "stop", 0, "e") for k in range(4)]
    alone = ClientSampler(client=None, tokenizer=tokenizer, api="chat")
    prepared = ClientSampler(client=None, tokenizer=tokenizer, api="chat")
    prepared.prepare(CONVERSATIONS)
    for messages in CONVERSATIONS:
        assert prepared._tokenize_all(messages, completions) == alone._tokenize_all(messages, completions)


def test_a_chat_server_that_returns_prompt_ids_never_templates(tokenizer):
    counting = CountingTokenizer(tokenizer)
    sampler = ClientSampler(client=None, tokenizer=counting, api="chat")
    sampler.prepare(CONVERSATIONS)
    given = Completion("x", [5, 6], [7], None, "stop", 0, "e")
    assert sampler._tokenize_all(CONVERSATIONS[0], [given]) == [given]
    assert counting.calls == 0


class _Recorder:
    def __init__(self):
        self.prepared: list[list[dict]] | None = None

    def prepare(self, conversations):
        self.prepared = list(conversations)

    async def complete(self, messages, *, n, sampling, prompt_ids=None):
        return [Completion("<answer>1</answer>", [1], [2], None, "stop", 0, "e") for _ in range(n)]


class _OneTurn(BaseEnv):
    name = "one-turn"

    def get_item(self, index):
        return Item(str(index), [{"role": "user", "content": f"q{index}"}])

    def score(self, item, completion):
        return 0.0


class _MultiTurn(_OneTurn):
    multi_turn = True

    async def collect_trajectories(self, item, sampler, sampling=None, n=None):
        return [Rollout(item.key, "", [1], [2], None, "stop", 0)]


def test_generate_items_prepares_one_turn_prompts_only():
    items = [_OneTurn().get_item(i) for i in range(3)]
    for env, expected in ((_OneTurn(), [item.messages for item in items]), (_MultiTurn(), None)):
        recorder = _Recorder()
        chunk = asyncio.run(generate_items(env, items, recorder, max_in_flight=2))
        assert recorder.prepared == expected
        assert len(chunk.rollouts) == 3


def test_samplers_without_prepare_still_work():
    class Plain:
        async def complete(self, messages, *, n, sampling: SamplingParams, prompt_ids=None):
            return [Completion("a", [1], [2], None, "stop", 0, "e") for _ in range(n)]

    chunk = asyncio.run(generate_items(_OneTurn(), [_OneTurn().get_item(0)], Plain(), max_in_flight=1))
    assert [len(group) for group in chunk.rollouts] == [_OneTurn().config.group_size]
