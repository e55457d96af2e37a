"""A scripted stand-in policy: an OpenAI-compatible server that answers from each environment's own references.

It shows that an environment scores correctly when a capable model answers, without a capable model: given
the items it may be asked about (`ReferencePolicy.add(env, items)`), it answers each request right or wrong,
and knows which. Per item the share of right answers in a group is fixed by a hash of its prompt: none, all,
half, or one of `group_size` (so some groups are all-equal and must be dropped, the others kept). A wrong
answer starts with `WRONG` ("Hmm. "), which no scorer reads, so the later turns of a multi-turn episode (and
a test) can tell which kind it is. Right answers come from the env's data: the gold answer, the reference
solution, the best move by the env's own search, the tool calls that find the total, the best hit/stand
plan for the dealt deck. It also judges for `llm_judge` (the answer without the mark wins), in rotating
verdict formats.

    with ReferencePolicyServer(policy) as url:   # POST {url}/v1/chat/completions
        ...
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from environments.base import BaseEnv, Item

WRONG = "Hmm. "
VERDICT_FORMATS = ("<verdict>{}</verdict>", "[[{}]]", "Verdict: {}", '{{"winner": "{}"}}')
_JUDGE_ANSWER = re.compile(r"\[Answer ([AB])\]\n(.*?)\n\[/Answer \1\]", re.DOTALL)

CODE_SOLUTIONS = {
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
    "is_palindrome": "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]\n",
    "fizzbuzz": ("def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' "
                 "if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n"),
    "digit_sum": "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
    "gcd": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "fib": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "running_sum": ("def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
                    "        out.append(total)\n    return out\n"),
    "second_largest": "def second_largest(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) > 1 else None\n",
    "flatten": ("def flatten(xs):\n    out = []\n    for x in xs:\n"
                "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out\n"),
}
"""Reference solutions of code_exec's problems (the env ships tests only)."""


def right_count(key: str, group_size: int) -> int:
    """How many of a group answer right: 0, all, half or one, by a hash of the prompt (`prompt_key`)."""
    share = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % 4
    return [0, group_size, group_size // 2, 1][share]


def prompt_key(messages: list[dict[str, Any]]) -> str:
    """An item's prompt as the server gets it (pictures included), the key it is found and counted by."""
    return json.dumps(messages, sort_keys=True)


def is_wrong(text: str) -> bool:
    return text.startswith(WRONG)


def _number(value: Any) -> str:
    return "-12345" if str(value).strip() != "-12345" else "-54321"


def _blackjack_plans(env: Any, item: Item) -> tuple[list[str], list[str]]:
    """(best, worst) hit/stand plans for the item's deck: hit k times, then stand."""
    from environments.blackjack import play_out

    rewards = {"natural": 1.5, "win": 1.0, "push": 0.0, "loss": -1.0, "invalid": -2.0}
    plans = [["hit"] * k + ["stand"] for k in range(env.config.max_turns)]
    ranked = sorted(plans, key=lambda plan: (rewards[play_out(item.answer, plan)[0]], -len(plan)))
    return ranked[-1], ranked[0]


def _replies(env: BaseEnv, item: Item, history: list[dict[str, Any]], right: bool) -> str:
    """The next reply for `env` on `item`, given the model's earlier replies in `history` (multi-turn)."""
    name, turn = env.name, sum(m["role"] == "assistant" for m in history)
    if name == "blackjack":
        best, worst = _blackjack_plans(env, item)
        plan = best if right else worst
        return f"<action>{plan[min(turn, len(plan) - 1)]}</action>"
    if name == "tool_calling":
        if not right:
            return f"<answer>{item.answer + 1}</answer>"
        goods = list(item.info["basket"])
        if turn < len(goods):
            return f'<tool_call>{json.dumps({"name": "price", "arguments": {"good": goods[turn]}})}</tool_call>'
        return f"<answer>{item.answer}</answer>"
    if name == "chess":
        if not right:
            return "I resign."
        from environments.chess_env import move_values

        fens = re.findall(r"FEN: (\S+ [wb] \S+ \S+ \d+ \d+)", history[-1]["content"] if history else "")
        fen = fens[-1] if turn and fens else item.answer
        values = move_values(fen, env.config.search_depth)
        return f"<move>{max(sorted(values), key=values.__getitem__)}</move>"
    if name == "code_exec":
        code = CODE_SOLUTIONS[item.answer] if right else f"def {item.answer}(*args):\n    raise ValueError('no')\n"
        return f"```python\n{code}```"
    if name == "intern_bootcamp":
        from environments.bootcamp_tasks import get_family

        return get_family(item.answer.family).reference_completion(item.answer) if right else "<answer>?</answer>"
    if name == "multiple_choice":
        letters = "ABCDEFGHIJ"[: len(item.info["choices"])]
        return f"The answer is ({item.answer if right else next(x for x in letters if x != item.answer)})."
    if name in ("gsm8k", "math"):
        answer = item.answer if right else _number(item.answer)
        return f"<think>worked it out</think> The answer is \\boxed{{{answer}}}."
    if name == "reasoning_gym":  # the item keeps reasoning-gym's whole entry; its gold answer is "answer"
        return f"<answer>{item.answer['answer'] if right else _number(item.answer['answer'])}</answer>"
    if name == "shape_count":
        return f"<answer>{item.answer if right else item.answer + 1}</answer>"
    if name == "llm_judge":
        return str(item.answer) if right else "I do not know."
    raise ValueError(f"the reference policy has no answers for env {name!r}; add them to _replies")


class ReferencePolicy:
    """Right and wrong answers for the items it was given; thread-safe (the server answers in threads)."""

    def __init__(self, group_size: int, *, always_right: bool = False) -> None:
        self.group_size = group_size
        self.always_right = always_right
        """Answer every request right: what a model that knows the references scores (README's table)."""
        self.items: dict[str, tuple[BaseEnv, Item]] = {}
        self.episodes: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self._formats = itertools.cycle(VERDICT_FORMATS)
        self._lock = threading.Lock()

    def add(self, env: BaseEnv, items: list[Item]) -> None:
        for item in items:
            self.items[prompt_key(item.messages)] = (env, item)

    def right_count(self, item: Item) -> int:
        """How many of the item's group this policy answers right (items with the same prompt share it)."""
        return right_count(prompt_key(item.messages), self.group_size)

    def complete(self, messages: list[dict[str, Any]], n: int) -> list[str]:
        """n replies to a chat request."""
        if len(messages) == 1 and messages[0]["content"].startswith("You are a strict judge"):
            return [self.judge(messages[0]["content"]) for _ in range(n)]
        for cut in range(len(messages), 0, -1):  # the item's prompt is the longest known prefix
            key = prompt_key(messages[:cut])
            found = self.items.get(key)
            if found is not None:
                break
        else:
            raise KeyError("a request for an item the reference policy was not given")
        env, item = found
        history = messages[cut:]
        replies = []
        for _ in range(n):
            if history:  # a later turn of an episode: its first reply says which kind it is
                right = not is_wrong(next(m["content"] for m in history if m["role"] == "assistant"))
            else:
                with self._lock:  # the k-th request for this prompt is answer k of its group
                    k = self.episodes[key]
                    self.episodes[key] += 1
                right = self.always_right or k % self.group_size < right_count(key, self.group_size)
            reply = _replies(env, item, history, right)
            replies.append(reply if right else WRONG + reply)
            with self._lock:
                self.answered["right" if right else "wrong"] += 1
        return replies

    def judge(self, prompt: str) -> str:
        answers = dict(_JUDGE_ANSWER.findall(prompt))
        a, b = is_wrong(answers.get("A", WRONG)), is_wrong(answers.get("B", WRONG))
        verdict = "tie" if a == b else ("B" if a else "A")
        with self._lock:
            form = next(self._formats)
        return form.format(verdict)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    policy: ReferencePolicy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": "reference-policy", "object": "model"}]})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": f"only /v1/chat/completions is served, not {self.path}"})
            return
        try:
            texts = self.policy.complete(body["messages"], int(body.get("n", 1)))
        except (KeyError, ValueError) as error:
            self._send(400, {"error": str(error)})
            return
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                   for i, t in enumerate(texts)]
        self._send(200, {"id": "ref", "object": "chat.completion", "model": body.get("model", ""), "choices": choices})


@contextmanager
def serve(policy: ReferencePolicy) -> Iterator[str]:
    """Serve `policy` on a free local port for the block; yields the base URL."""
    handler: Callable[..., _Handler] = type("Handler", (_Handler,), {"policy": policy})
    server_cls = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 512})  # whole groups connect at once
    server = server_cls(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
