"""Code execution: right, wrong and malformed answers, and hostile submissions that must each score 0 while the
scorer worker stays healthy; plus what isolation the sandbox really has on this machine."""

from __future__ import annotations

import os
import time

import pytest

from environments.base import EnvSpec, Rollout
from environments.code_exec import PROBLEMS, CodeExecConfig, CodeExecEnv, extract_code
from factory.sandbox import SandboxLimits, SandboxUnavailable, missing_requirement, run_python
from tasks.score import score_chunk

REF = "environments.code_exec:CodeExecEnv"
FAST = {"wall_s": 2.0, "cpu_s": 1}


def answer(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


GOOD_GCD = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a"
STUB = "def gcd(a, b):\n    return -1"
# Each attack is followed by a correct gcd, except where succeeding would not help the program (signals): a
# score above 0 means the attack was not stopped.
HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "infinite loop": "while True:\n    pass",
    "sleeps forever": "import time\ntime.sleep(1000)",
    "memory hog": "x = bytearray(4 << 30)",
    "huge output": "while True:\n    print('x' * 100000)",
    "huge file": "open('f', 'wb').write(b'x' * (64 << 20))",
    "reads the project": f"print(open({os.path.abspath(__file__)!r}).read())",
    "lists /root": "import os\nassert os.listdir('/root'), 'empty: hidden'",
    "opens a socket": "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)",
    "raw socket": "import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', PORT))",
    "exits early": "raise SystemExit(0)",
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + STUB,
    "kills everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\n" + STUB,
    "sysv shared memory": "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
                          "for i in range(3):  # 450 MB pinned in detached segments, over the 256 MB cap\n"
                          "    a = libc.shmat(libc.shmget(0x5A5B0001 + i, 150 << 20, 0o1666), None, 0)\n"
                          "    ctypes.memset(a, 1, 150 << 20)\n    libc.shmdt(ctypes.c_void_p(a))",
    "disk fill": "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20)); i += 1",
    "processes x memory": "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
                          "        x = b'x' * (200 << 20)\n        time.sleep(10)\nx = b'x' * (200 << 20)",
}


@pytest.fixture(scope="module")
def listener():
    """A live TCP port on this machine: without network isolation the socket attacks would connect."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


pytestmark = pytest.mark.skipif(bool(missing_requirement()), reason=missing_requirement() or "ok")


def hostile(name: str, port: int) -> str:
    code = HOSTILE[name].replace("PORT", str(port))
    return code if code.endswith(STUB) else code + "\n" + GOOD_GCD


def env(**config) -> CodeExecEnv:
    return CodeExecEnv(CodeExecConfig(problems=["gcd"], **FAST, **config))


def test_right_wrong_and_malformed_answers():
    e = env()
    item = e.get_item(0)
    assert item.answer == "gcd" and "gcd(a, b)" in item.messages[-1]["content"]
    assert e.score(item, answer(GOOD_GCD)) == 1.0 and e.is_correct(item, answer(GOOD_GCD))
    assert e.score(item, answer("def gcd(a, b):\n    return a")) == pytest.approx(1 / 3)  # passes gcd(7, 0) only
    assert e.score(item, answer("def gcd(a, b):\n    return 1 / 0")) == 0.0
    assert e.score(item, GOOD_GCD) == 0.0                                  # no code block
    assert e.score(item, answer("def gcd(a, b) return a")) == 0.0          # syntax error
    assert e.score(item, answer("def lcm(a, b):\n    return a")) == 0.0    # wrong function
    assert extract_code("```py\nx = 1\n```\n```python\ny = 2\n```") == "y = 2\n"


def test_reference_like_solutions_pass_every_problem():
    solutions = {
        "reverse_words": "def reverse_words(s):\n    return ' '.join(s.split()[::-1])",
        "fib": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "second_largest": "def second_largest(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) > 1 else None",
    }
    for name, code in solutions.items():
        e = CodeExecEnv(CodeExecConfig(problems=[name], **FAST))
        assert e.score(e.get_item(0), answer(code)) == 1.0, name
    assert len(PROBLEMS) >= 10


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_submission_scores_zero(name, listener):
    e = env()
    started = time.monotonic()
    assert e.score(e.get_item(0), answer(hostile(name, listener))) == 0.0
    assert time.monotonic() - started < 15
    assert e.score(e.get_item(0), answer(GOOD_GCD)) == 1.0  # and this process is fine


def test_sandbox_isolation_on_this_machine(caplog):
    result = run_python("import os\nprint(os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))",
                        limits=SandboxLimits(wall_s=5))
    assert result.ok, result.stderr
    uid, pids = result.stdout.split(" ", 1)
    assert int(uid) >= 1 << 28 and pids.strip() == "['1', '2']"  # its own uid; its init and itself
    assert set(result.isolation["namespaces"]) >= {"mount", "pid", "network", "ipc"}
    assert result.isolation["filesystem"] is True and "MB" in result.isolation["memory_limit"]
    big = run_python("print('y' * 10**7)", limits=SandboxLimits(file_mb=1))
    assert big.reason == "output" and len(big.stdout) <= SandboxLimits().output_chars
    with caplog.at_level("INFO", logger="environments.code_exec"):
        env().setup()
    assert "memory" in caplog.text and "disk 16 MB tmpfs" in caplog.text  # the env says which limits apply


def test_a_host_without_the_sandbox_is_refused_at_start_up(monkeypatch):
    """No silent unconfined run: setup() and every run raise one line that names what is missing."""
    import factory.sandbox as sandbox

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)  # not root, and user namespaces switched off
    monkeypatch.setattr(sandbox, "_read_text", lambda path: "0" if path.endswith("max_user_namespaces") else "")
    monkeypatch.setattr(sandbox, "_checked", None)
    with pytest.raises(SandboxUnavailable, match=r"needs root or unprivileged user namespaces; this process runs as "
                                                 r"uid 1000 and user.max_user_namespaces is 0: run the scorer as "
                                                 r"root, or allow user namespaces \(sysctl\)") as error:
        env().setup()
    assert "\n" not in str(error.value)
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)")


def test_hostile_group_in_the_scorer_processes_scores_zero_and_the_workers_stay_healthy(listener):
    spec = EnvSpec(REF, {"problems": ["gcd"], **FAST})
    item = env().get_item(0)
    names = list(HOSTILE)
    texts = [answer(hostile(name, listener)) for name in names] + [answer(GOOD_GCD)]
    rollouts = [Rollout(item.key, t, [1], [2], None, "stop", 0) for t in texts]
    parent = os.getpid()
    score_chunk(spec, [item], [rollouts], timeout_s=120, workers=1, mode="process")
    assert [r.error for r in rollouts] == [None] * len(texts)
    assert [r.score for r in rollouts] == [0.0] * len(names) + [1.0]
    again = [Rollout(item.key, answer(GOOD_GCD), [1], [2], None, "stop", 0)]
    score_chunk(spec, [item], [again], timeout_s=60, workers=1, mode="process")  # the same worker, still healthy
    assert again[0].score == 1.0 and os.getpid() == parent
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid >= 200_000]
    assert leftovers == [] or all(open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in leftovers)
    with open("/proc/sysvipc/shm") as segments:  # the SysV segment died with the submission's IPC namespace
        assert not [line for line in segments if line.split()[0] in (str(0x5A5B0001 + i) for i in range(3))]
