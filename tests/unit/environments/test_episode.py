"""The multi-turn contract: episodes keep the whole conversation, and masks cover exactly the model's own tokens,
checked on the starter policy's real tokenizer and chat template."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from environments.base import BaseEnv, EnvConfig, Item, Rollout
from environments.episode import Episode, env_turn_ids
from environments.groups import MASK_IGNORE
from factory.inference.types import Completion, SamplingParams
from tasks.group import build_group, sequence_tokens
from tests.unit.environments.scripted import ScriptedSampler

class Countdown(BaseEnv):
    """A toy multi-turn env: the user says a number, the model replies, the env says the next number."""

    name = "countdown"
    multi_turn = True

    def get_item(self, index: int) -> Item:
        return Item(key=f"c:{index}", messages=self.chat("3"), answer=0)

    async def play(self, item: Item, episode: Episode) -> None:
        for number in ("2", "1"):
            await episode.model_turn()
            episode.add({"role": "user", "content": number})
        await episode.model_turn()

    def score(self, item: Item, completion: Any) -> float:
        assert isinstance(completion, list)
        return float(sum(m["role"] == "assistant" for m in completion))


def trained_spans(tokens: list[int], masks: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, mask in zip(tokens, masks):
        if mask == MASK_IGNORE:
            if current:
                spans.append(current)
            current = []
        else:
            assert mask == token
            current.append(token)
    return [*spans, current] if current else spans


@pytest.mark.parametrize("closed", [True, False])
def test_masks_cover_only_the_model_turns_on_real_token_ids(tokenizer, closed):
    replies = ["two", "one 1", "zero"]
    env = Countdown(EnvConfig(group_size=1, system_prompt="count down"))
    sampler = ScriptedSampler(tokenizer, replies, close=closed)
    [rollout] = asyncio.run(env.collect_trajectories(env.get_item(0), sampler))

    assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in rollout.messages if m["role"] == "assistant"] == replies
    tokens, masks, logprobs = sequence_tokens(rollout)
    eos = [tokenizer.eos_token_id] if closed else []
    expected = [list(tokenizer.encode(r, add_special_tokens=False)) + eos for r in replies]
    assert trained_spans(tokens, masks) == expected  # exactly the model's own ids, nothing of the env's
    assert [lp for lp, m in zip(logprobs, masks) if m != MASK_IGNORE] == [-0.5] * sum(map(len, expected))
    assert all(lp == 1.0 for lp, m in zip(logprobs, masks) if m == MASK_IGNORE)
    # The sequence is the chat template's rendering of the whole conversation (closed turns), token for token,
    # and each turn was sampled from exactly the prefix that ends up in the sequence.
    if closed:
        full = tokenizer.apply_chat_template(rollout.messages, tokenize=False)
        assert tokenizer.decode(tokens) + "\n" == full  # all but the template's newline after the last turn
    for prompt in sampler.seen_prompts[1:]:
        assert tokens[: len(prompt)] == prompt
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    if not closed:  # a reply cut by max_tokens gets the template's closing tag as an env (masked) token
        assert "two<|im_end|>\n<|im_start|>user\n2<|im_end|>" in tokenizer.decode(sampler.seen_prompts[1])


def test_group_keeps_whole_conversations_and_scores_them(tokenizer):
    env = Countdown(EnvConfig(group_size=2))
    item = env.get_item(0)
    rollouts = asyncio.run(env.collect_trajectories(item, ScriptedSampler(tokenizer, ["a", "b", "c", "d", "e", "f"])))
    for r in rollouts:
        r.score = env.score(item, r.scoring_input())
    group = build_group("countdown", item, rollouts, group_size=2, max_token_length=512, ensure_scores_are_not_same=False)
    assert group.messages == [r.messages for r in rollouts] and group.scores == [3.0, 3.0]
    assert group.policy_version == 3


def test_single_turn_rollouts_are_unchanged():
    r = Rollout("k", "hi", [1, 2], [3, 4], [-0.1, -0.2], "stop", 0)
    assert sequence_tokens(r) == ([1, 2, 3, 4], [MASK_IGNORE, MASK_IGNORE, 3, 4], [1.0, 1.0, -0.1, -0.2])
    assert r.scoring_input() == "hi"


def test_env_turn_ids_refuses_a_template_that_is_not_prefix_stable():
    class Odd:
        eos_token = "<e>"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "|".join(m["content"] for m in reversed(messages))

        def encode(self, text, add_special_tokens):
            return [1]

    with pytest.raises(ValueError, match="prefix-stable"):
        env_turn_ids(Odd(), [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                     [{"role": "user", "content": "c"}], model_closed=True)


def test_episode_without_a_tokenizer_keeps_messages_but_no_tokens():
    class ChatOnly:  # an OpenAI-style server that returns text only, and no tokenizer to render env turns
        async def complete(self, messages, *, n, sampling, prompt_ids=None):
            assert prompt_ids is None
            return [Completion("ok", None, None, None, "stop", 0, "fake")] * n

    env = Countdown(EnvConfig(group_size=1))
    [r] = asyncio.run(env.collect_trajectories(env.get_item(0), ChatOnly(), SamplingParams(max_tokens=4)))
    assert len(r.messages) == 6 and r.output_token_ids is None  # grouped as "failed": never silently wrong masks


def test_groups_html_shows_every_turn_of_a_conversation(tmp_path):
    import base64
    import json

    from flows.datagen_cli import write_groups_html

    conversation = [{"role": "user", "content": "3"}, {"role": "assistant", "content": "two"},
                    {"role": "user", "content": "1"}, {"role": "assistant", "content": "zero"}]
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()
    picture = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}},
                                             {"type": "text", "text": "count"}]}, {"role": "assistant", "content": "4"}]
    lines = [{"item_key": "k", "scores": [1.0], "messages": [conversation]},
             {"item_key": "m", "scores": [0.0], "messages": [picture]}]
    (tmp_path / "g.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    write_groups_html(tmp_path / "g.jsonl", tmp_path / "g.html", title="t")
    page = (tmp_path / "g.html").read_text()
    assert all(f"<pre>{word}</pre>" in page for word in ("3", "two", "1", "zero", "count"))
    assert f'src="{png}"' in page  # view-run's templates show image parts inline
