"""Tool calling, multi-turn: look up prices with tools, compute a bill, answer; tool results are fed back each turn.

The system prompt describes two tools (name, arguments, what they do; their JSON schemas are in `TOOLS`). The model calls them
as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes/Qwen
style); the environment parses every call in a turn, runs it and answers with
a `tool` message per call (`<tool_response>…</tool_response>`), for at most
`max_turns` model turns. A turn without a call ends the episode; its
`<answer>` is the final answer. Items are generated (no download): a shop's
hidden price list, a shopping list, the total to find.

Another round is played only while the conversation has room for the tool results (`response_tokens` per
call) and a short final turn (`answer_tokens`) within `max_token_length`; a turn never samples past it.
`compact_prompt` swaps the system prompt for a third of its tokens, so a small context (the starter policy's
512) holds two or three tool rounds (deployments/tool_calling.yaml; tool_calling_4k.yaml for bigger models).

Reward (a pure function of the conversation): `correct_reward` for the right
total, plus `call_reward` times (well-formed calls - malformed calls) / calls.
A call is well formed when its JSON parses, names a known tool and passes the
arguments that tool requires.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item
from environments.episode import Episode

GOODS = ("apple", "bread", "cheese", "eggs", "milk", "rice", "soap", "tea", "pasta", "honey", "salt", "jam")
TOOLS = [
    {"name": "price", "description": "unit price of one good in the shop, in cents",
     "parameters": {"type": "object", "properties": {"good": {"type": "string"}}, "required": ["good"]}},
    {"name": "calculator", "description": "value of an arithmetic expression with + - * / and parentheses",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
]
_REQUIRED = {tool["name"]: tool["parameters"]["required"] for tool in TOOLS}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}

SYSTEM_PROMPT = (
    "Tools: " + "; ".join(f"{t['name']}({', '.join(t['parameters']['required'])}): {t['description']}" for t in TOOLS)
    + '\nCall one as <tool_call>{"name": "price", "arguments": {"good": "tea"}}</tool_call>; its result comes back '
    "in <tool_response>. To finish, reply without a call and put the number in <answer></answer>."
)

COMPACT_SYSTEM_PROMPT = (
    "Tools: price(good), calculator(expression). Call: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    ". Answer: <answer>N</answer>."
)
"""For small contexts (the starter policy's 512 tokens): the tools in a third of the full prompt's tokens."""


class ToolCallingConfig(EnvConfig):
    """The `env.` section for tool calling."""

    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message describing the tools and formats.")
    compact_prompt: bool = Field(False, description="Use COMPACT_SYSTEM_PROMPT (when system_prompt is the default).")
    max_turns: int = Field(4, ge=1, description="Most model turns per episode (tool rounds + the final answer).")
    response_tokens: int = Field(40, ge=1, description="Room kept per tool result when deciding if another round fits.")
    answer_tokens: int = Field(24, ge=1, description="Room a model turn needs at least (a final <answer>).")
    max_goods: int = Field(2, ge=1, le=len(GOODS), description="Most different goods on a shopping list.")
    correct_reward: float = Field(1.0, description="Reward for the right total in the final <answer>.")
    call_reward: float = Field(0.2, ge=0.0, description="Weight of (well-formed - malformed) / calls.")
    max_tokens: int = Field(64, ge=1, description="Most new tokens per model turn.")


def parse_calls(text: str) -> list[dict[str, Any] | str]:
    """Every `<tool_call>` in a turn: the call as a dict when well formed, else a string saying what is wrong."""
    calls: list[dict[str, Any] | str] = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(f"invalid JSON: {error.msg}")
            continue
        if not isinstance(call, dict) or call.get("name") not in _REQUIRED:
            calls.append(f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}")
            continue
        args = call.get("arguments")
        if not isinstance(args, dict) or any(not isinstance(args.get(k), str) for k in _REQUIRED[call["name"]]):
            calls.append(f"{call['name']} needs string arguments {_REQUIRED[call['name']]}")
            continue
        calls.append(call)
    return calls


def calculate(expression: str) -> float:
    """Arithmetic only (numbers, + - * /, parentheses): no names, no calls, no attribute access."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return value(ast.parse(expression, mode="eval").body)


def run_call(call: dict[str, Any] | str, prices: dict[str, int]) -> str:
    """The tool's answer (or the error, so the model can fix its call next turn)."""
    if isinstance(call, str):
        return f"error: {call}"
    args = call["arguments"]
    if call["name"] == "price":
        good = args["good"].strip().lower()
        return str(prices[good]) if good in prices else f"error: no good named {good!r}; goods: {', '.join(prices)}"
    try:
        result = calculate(args["expression"])
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError) as error:
        return f"error: {error}"
    return f"{result:g}"


def grade(messages: list[dict[str, Any]], total: int, correct_reward: float, call_reward: float) -> float:
    """Reward of a whole conversation: the final answer, and the share of well-formed tool calls."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    calls = [c for reply in replies for c in parse_calls(reply)]
    reward = 0.0
    final = replies[-1] if replies else ""
    found = _ANSWER.findall(final) if not _CALL.search(final) else []
    if found:
        try:
            reward += correct_reward if float(found[-1].strip().replace(",", "")) == total else 0.0
        except ValueError:
            pass
    if calls:
        good = sum(isinstance(c, dict) for c in calls)
        reward += call_reward * (good - (len(calls) - good)) / len(calls)
    return reward


class ToolCallingEnv(BaseEnv):
    name = "tool_calling"
    config_cls = ToolCallingConfig
    multi_turn = True
    scoring = "inline"  # regex + JSON over a few messages: bounded and cheap
    config: ToolCallingConfig

    def get_item(self, index: int) -> Item:
        rng = random.Random(f"{self.config.seed}:{index}")
        prices = {good: rng.randint(5, 400) for good in GOODS}
        basket = {good: rng.randint(1, 9) for good in rng.sample(GOODS, rng.randint(1, self.config.max_goods))}
        wanted = " and ".join(f"{n} {good}" for good, n in basket.items())
        question = f"What do {wanted} cost in total, in cents?"
        total = sum(prices[g] * n for g, n in basket.items())
        return Item(key=f"tools:{self.config.seed}:{index}", messages=self.chat(question), answer=total,
                    info={"prices": prices, "basket": basket})

    def chat(self, user: str) -> list[dict[str, Any]]:
        if self.config.compact_prompt and self.config.system_prompt == SYSTEM_PROMPT:
            return [{"role": "system", "content": COMPACT_SYSTEM_PROMPT}, {"role": "user", "content": user}]
        return super().chat(user)

    async def play(self, item: Item, episode: Episode) -> None:
        cfg = self.config
        for turn in range(cfg.max_turns):
            calls = parse_calls(await episode.model_turn())
            if not calls or turn == cfg.max_turns - 1 or episode.out_of_room(cfg.response_tokens * len(calls),
                                                                               cfg.answer_tokens):
                return
            episode.add(*({"role": "tool", "content": f"<tool_response>{run_call(c, item.info['prices'])}</tool_response>"}
                          for c in calls))

    def score(self, item: Item, completion: Any) -> float:
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return grade(messages, item.answer, self.config.correct_reward, self.config.call_reward)

    def is_correct(self, item: Item, completion: Any) -> bool:
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return grade(messages, item.answer, 1.0, 0.0) >= 1.0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.tool_calling:ToolCallingEnv"))
