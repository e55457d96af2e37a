"""Code execution: write a Python function that passes hidden tests; submissions run in the sandbox.

Problems are the project's own (`PROBLEMS`: a name, a description, hidden test inputs and outputs). The
model answers with a ```python block; scoring runs it in `factory.sandbox` with a harness that calls the
function on each hidden input and prints the results after a random nonce; the outputs are compared here, so
the expected values never enter the sandbox. Reward: the fraction of hidden tests passed (`pass_reward` when
all pass); 0 for no code block, code that crashes, hangs, or misbehaves in any other way.

Totals per submission (all its processes together), from the config below: memory `memory_mb` (a cgroup;
tmpfs files count too), processes and threads `processes`, disk `disk_mb` of private tmpfs (the only writable
place; `file_mb` per file, stdout included), time `wall_s` of wall clock (`cpu_s` CPU seconds per process); no
network, own IPC/PID/mount namespaces, its own uid. `setup()` refuses a host that cannot isolate submissions
(one line naming what is missing) and logs which memory limit is in force there.
"""

from __future__ import annotations

import json
import logging
import random
import re
import secrets
from typing import Any

from pydantic import Field, field_validator

from environments.base import BaseEnv, EnvConfig, Item
from factory.sandbox import SandboxLimits, require_sandbox, run_python, sandbox_summary

log = logging.getLogger(__name__)

PROBLEMS: dict[str, tuple[str, list[tuple[list[Any], Any]]]] = {
    "reverse_words": ("reverse_words(s) returns the words of s in reverse order, joined by single spaces.",
                      [(["a b c"], "c b a"), (["hello"], "hello"), ([" x  y "], "y x")]),
    "is_palindrome": ("is_palindrome(s) says whether s reads the same backwards, ignoring case.",
                      [(["Abba"], True), (["abc"], False), ([""], True)]),
    "fizzbuzz": ("fizzbuzz(n) returns the list for 1..n: 'Fizz' for multiples of 3, 'Buzz' of 5, 'FizzBuzz' of "
                 "both, else the number as a string.", [([5], ["1", "2", "Fizz", "4", "Buzz"]), ([0], [])]),
    "digit_sum": ("digit_sum(n) returns the sum of the decimal digits of the integer n (ignore the sign).",
                  [([123], 6), ([-45], 9), ([0], 0)]),
    "count_vowels": ("count_vowels(s) returns how many of the letters a, e, i, o, u (any case) s has.",
                     [(["Banana"], 3), (["xyz"], 0), (["AEIOU"], 5)]),
    "gcd": ("gcd(a, b) returns the greatest common divisor of two non-negative integers.",
            [([12, 18], 6), ([7, 0], 7), ([17, 5], 1)]),
    "fib": ("fib(n) returns the n-th Fibonacci number, fib(0) = 0, fib(1) = 1.", [([0], 0), ([1], 1), ([10], 55)]),
    "running_sum": ("running_sum(xs) returns the list of prefix sums of the list xs.",
                    [([[1, 2, 3]], [1, 3, 6]), ([[]], []), ([[5, -5]], [5, 0])]),
    "second_largest": ("second_largest(xs) returns the second largest distinct value of xs, or None if there is "
                       "none.", [([[3, 1, 3, 2]], 2), ([[1, 1]], None), ([[9, 4]], 4)]),
    "flatten": ("flatten(xs) flattens a list of lists of any depth into one list.",
                [([[1, [2, [3]], 4]], [1, 2, 3, 4]), ([[]], []), ([[[[]]]], [])]),
}
_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
HARNESS = """import json, sys
nonce = sys.stdin.readline().strip()
inputs = json.load(open("inputs.json"))
space = {"__name__": "submission"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), space)
results = []
for args in inputs:
    try:
        results.append(["ok", space[%r](*args)])
    except Exception as error:
        results.append(["error", type(error).__name__])
sys.stdout.write("\\n" + nonce + json.dumps(results, default=repr) + "\\n")
"""


class CodeExecConfig(EnvConfig):
    """The `env.` section for code execution."""

    problems: list[str] | None = Field(None, description="Problem names to draw from; None for all of PROBLEMS.")
    pass_reward: float = Field(1.0, description="Reward when every hidden test passes; partial passes scale it.")
    cpu_s: int = Field(2, ge=1, description="CPU seconds per process of a submission (the wall clock bounds the "
                                            "total).")
    wall_s: float = Field(4.0, gt=0, description="Wall-clock seconds per submission before all its processes are "
                                                 "killed.")
    memory_mb: int = Field(256, ge=32, description="Memory of the whole submission, all processes and its tmpfs "
                                                   "files together (cgroup; where the host delegates none: per "
                                                   "process, and the log says so); also each process's address "
                                                   "space.")
    processes: int = Field(16, ge=1, description="Processes and threads of the whole submission together.")
    disk_mb: int = Field(16, ge=1, description="Private tmpfs of the submission (/tmp and /dev/shm), its only "
                                               "writable place; gone when it ends.")
    file_mb: int = Field(1, ge=1, description="Largest file a submission may write, its stdout included.")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per completion.")

    @field_validator("problems")
    @classmethod
    def _known(cls, value: list[str] | None) -> list[str] | None:
        unknown = sorted(set(value or []) - set(PROBLEMS))
        if unknown or value == []:
            raise ValueError(f"unknown problems {unknown or value}; known: {', '.join(sorted(PROBLEMS))}")
        return value


def extract_code(completion: str) -> str | None:
    """The last fenced code block (```python … ```), or None."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def run_tests(code: str, name: str, tests: list[tuple[list[Any], Any]], limits: SandboxLimits) -> float:
    """Fraction of `tests` the function `name` in `code` passes inside the sandbox (0.0 on any failure)."""
    nonce = secrets.token_hex(16)
    files = {"solution.py": code, "inputs.json": json.dumps([args for args, _ in tests])}
    result = run_python(HARNESS % name, stdin=nonce + "\n", files=files, limits=limits)
    if result.reason:
        return 0.0
    line = next((x for x in reversed(result.stdout.splitlines()) if x.startswith(nonce)), None)
    if line is None:
        return 0.0
    try:
        outputs = json.loads(line[len(nonce):])
    except json.JSONDecodeError:
        return 0.0
    expected = json.loads(json.dumps([want for _, want in tests]))
    passed = sum(1 for got, want in zip(outputs, expected) if got == ["ok", want])
    return passed / len(tests)


class CodeExecEnv(BaseEnv):
    name = "code_exec"
    config_cls = CodeExecConfig
    config: CodeExecConfig

    @property
    def limits(self) -> SandboxLimits:
        c = self.config
        return SandboxLimits(cpu_s=c.cpu_s, wall_s=c.wall_s, memory_mb=c.memory_mb, processes=c.processes,
                             disk_mb=c.disk_mb, file_mb=c.file_mb)

    def setup(self) -> None:
        """Refuse to start where submissions cannot be isolated; log the limits in force on this host."""
        require_sandbox()
        log.info("code_exec sandbox per submission: %s", sandbox_summary(self.limits))

    def get_item(self, index: int) -> Item:
        names = self.config.problems or sorted(PROBLEMS)
        name = random.Random(f"{self.config.seed}:{index}").choice(names)
        description, _ = PROBLEMS[name]
        prompt = f"Write a Python function. {description} Reply with the code in one ```python block."
        return Item(key=f"code:{name}:{index}", messages=self.chat(prompt), answer=name)

    def score(self, item: Item, completion: str) -> float:
        code = extract_code(completion)
        if code is None or f"def {item.answer}" not in code:
            return 0.0
        return self.config.pass_reward * run_tests(code, item.answer, PROBLEMS[item.answer][1], self.limits)

    def is_correct(self, item: Item, completion: str) -> bool:
        return self.score(item, completion) >= self.config.pass_reward


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.code_exec:CodeExecEnv"))
