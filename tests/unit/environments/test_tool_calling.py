"""Tool calling: call parsing (right, wrong, malformed), the safe calculator, rewards, and a whole scripted episode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from environments.groups import MASK_IGNORE
from environments.tool_calling import ToolCallingConfig, ToolCallingEnv, calculate, grade, parse_calls, run_call
from tasks.group import build_group
from tests.unit.environments.scripted import ScriptedSampler

REPO = Path(__file__).resolve().parents[3]


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_parse_calls_well_formed_and_malformed():
    text = (call("price", good="tea") + call("calculator", expression="2*3") + "<tool_call>{not json</tool_call>"
            + call("weather", city="x") + call("price", item="tea"))
    parsed = parse_calls(text)
    assert parsed[:2] == [{"name": "price", "arguments": {"good": "tea"}},
                          {"name": "calculator", "arguments": {"expression": "2*3"}}]
    assert parsed[2].startswith("invalid JSON") and parsed[3].startswith("unknown tool")
    assert "needs string arguments" in parsed[4]
    assert parse_calls("no calls here") == []


def test_calculator_is_arithmetic_only():
    assert calculate("(3 + 4) * 2 - 1/2") == 13.5
    for hostile in ("__import__('os').system('true')", "x", "(1).real", "2**99999"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(hostile)
    assert run_call({"name": "calculator", "arguments": {"expression": "1/0"}}, {}).startswith("error")
    assert run_call({"name": "price", "arguments": {"good": " Tea "}}, {"tea": 7}) == "7"
    assert "no good named" in run_call({"name": "price", "arguments": {"good": "gold"}}, {"tea": 7})


def convo(*replies: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, *({"role": "assistant", "content": r} for r in replies)]


def test_grade_right_wrong_and_malformed():
    assert grade(convo(call("price", good="tea"), "<answer>42</answer>"), 42, 1.0, 0.2) == pytest.approx(1.2)
    assert grade(convo("<answer>42</answer>"), 42, 1.0, 0.2) == 1.0                  # right without tools
    assert grade(convo(call("price", good="tea"), "<answer>41</answer>"), 42, 1.0, 0.2) == pytest.approx(0.2)
    assert grade(convo("<tool_call>{bad</tool_call>", "<answer>4 2</answer>"), 42, 1.0, 0.2) == pytest.approx(-0.2)
    assert grade(convo(call("price", good="tea")), 42, 1.0, 0.2) == pytest.approx(0.2)  # never answered
    assert grade(convo(), 42, 1.0, 0.2) == 0.0


def test_scripted_episode_runs_tools_feeds_results_back_and_masks_only_the_model(tokenizer):
    env = ToolCallingEnv(ToolCallingConfig(group_size=1, max_goods=1))
    item = env.get_item(0)
    assert item.info["prices"] and "<tool_call>" in item.messages[0]["content"]
    [(good, count)] = item.info["basket"].items()
    replies = [call("price", good=good) + call("nope"),
               call("calculator", expression=f"{item.info['prices'][good]}*{count}"),
               f"<answer>{item.answer}</answer>"]
    sampler = ScriptedSampler(tokenizer, replies)
    [rollout] = asyncio.run(env.collect_trajectories(item, sampler))

    roles = [m["role"] for m in rollout.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert rollout.messages[3]["content"] == f"<tool_response>{item.info['prices'][good]}</tool_response>"
    assert rollout.messages[4]["content"].startswith("<tool_response>error: unknown tool")
    assert rollout.messages[6]["content"] == f"<tool_response>{item.answer}</tool_response>"
    rollout.score = env.score(item, rollout.scoring_input())
    assert rollout.score == pytest.approx(1.0 + 0.2 * (2 - 1) / 3)
    group = build_group("tool_calling", item, [rollout], group_size=1, max_token_length=4096)
    tokens, masks = group.tokens[0], group.masks[0]
    trained = tokenizer.decode([t for t, m in zip(tokens, masks) if m != MASK_IGNORE])
    assert trained == "".join(r + "<|im_end|>" for r in replies)  # the model's turns, nothing else
    assert "tool_response" in tokenizer.decode(tokens) and group.messages[0] == rollout.messages


def test_episode_stops_after_max_turns(tokenizer):
    env = ToolCallingEnv(ToolCallingConfig(group_size=1, max_turns=2))
    sampler = ScriptedSampler(tokenizer, [call("price", good="tea")] * 2)
    [rollout] = asyncio.run(env.collect_trajectories(env.get_item(1), sampler))
    assert [m["role"] for m in rollout.messages][-3:] == ["assistant", "tool", "assistant"]
    assert env.is_correct(env.get_item(1), rollout.scoring_input()) is False


def test_the_shipped_config_fits_several_tool_rounds_in_the_starter_context(tokenizer):
    """deployments/tool_calling.yaml on the starter's 512 tokens: price, price, answer; every result fed back.

    (A calculator round on top needs about 40 tokens more than 512 with this tokenizer: tool_calling_4k.yaml.)"""
    _check_episode(tokenizer, "tool_calling.yaml", calculator=False)


def test_the_4k_config_fits_lookups_a_calculator_round_and_the_answer(tokenizer):
    _check_episode(tokenizer, "tool_calling_4k.yaml", calculator=True)


def _check_episode(tokenizer, config_file, calculator):
    from flows.datagen import build_job_config
    from flows.env_library import LIBRARY
    from tasks.group import sequence_tokens

    cfg = build_job_config(LIBRARY["tool_calling"], config_path=str(REPO / "deployments" / config_file)).env
    env = ToolCallingEnv(cfg)
    item = next(env.get_item(i) for i in range(200) if len(env.get_item(i).info["basket"]) == 2)
    (a, n), (b, m) = item.info["basket"].items()
    prices = item.info["prices"]
    replies = [call("price", good=a), call("price", good=b)]
    if calculator:
        replies.append(call("calculator", expression=f"{prices[a]}*{n}+{prices[b]}*{m}"))
    replies.append(f"<answer>{item.answer}</answer>")
    sampler = ScriptedSampler(tokenizer, replies, truncate=True)
    rollout = asyncio.run(env.run_episode(item, sampler, env.sampling()))
    roles = [message["role"] for message in rollout.messages]
    assert roles.count("assistant") == len(replies) >= 3
    assert roles.count("tool") == sum(len(parse_calls(reply)) for reply in replies)
    results = [message["content"] for message in rollout.messages if message["role"] == "tool"]
    assert results[:2] == [f"<tool_response>{prices[a]}</tool_response>", f"<tool_response>{prices[b]}</tool_response>"]
    assert env.score(item, rollout.scoring_input()) == pytest.approx(cfg.correct_reward + cfg.call_reward)
    tokens, _, _ = sequence_tokens(rollout)
    assert len(tokens) <= cfg.max_token_length and rollout.finish_reason == "stop"
