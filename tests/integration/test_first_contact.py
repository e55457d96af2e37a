"""A newcomer's user errors end within 10 s, exit non-zero, and name the cause and the fix on the last line.

Each case runs the real command in a subprocess (the console script or `python -m`), as a user types it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], *, timeout: float = 10.0, cwd: Path | None = None) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    began = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout + 20, env=env, cwd=cwd or ROOT)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def assert_user_error(code: int, output: str, seconds: float, *, expect: str, exit_code: int = 1) -> None:
    assert code == exit_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert expect in last_line(output), output[-3000:]
    assert seconds < 10, f"took {seconds:.1f} s"


def test_run_api_unwritable_store(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, seconds = run([sys.executable, "-m", "factory.serve.cli", "--store_root", str(blocker / "store")])
    assert_user_error(code, out, seconds, expect="store_root")
    assert "not writable" in last_line(out)


def test_run_api_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, out, seconds = run([sys.executable, "-m", "factory.serve.cli", "--host", "127.0.0.1", "--port", str(port),
                                  "--store_root", str(tmp_path / "store")])
    assert_user_error(code, out, seconds, expect=f"port {port} on 127.0.0.1 is already in use")
    assert f"by pid {os.getpid()}" in last_line(out) and "--port" in last_line(out)


def test_policy_server_port_in_use() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, out, seconds = run([sys.executable, "-m", "factory.inference.local_server", "--model",
                                  str(ROOT / "models" / "starter-policy"), "--port", str(port)])
    if "not a HF model directory" in out:
        pytest.skip("no starter policy built here (scripts/build_starter_policy.py)")
    assert_user_error(code, out, seconds, expect=f"port {port} on 127.0.0.1 is already in use")


def test_export_flow_missing_store(tmp_path: Path) -> None:
    code, out, seconds = run([sys.executable, "-m", "flows.export", "sft", "--output.path", str(tmp_path / "out"),
                              "--source.store", str(tmp_path / "no-store")])
    assert_user_error(code, out, seconds, expect="holds no runs: check source.store")
    assert "Starting temporary server" not in out  # refused before any flow run


def test_train_unknown_hub_model_offline(tmp_path: Path) -> None:
    code, out, seconds = run([sys.executable, "-m", "flows.train", "--train.model_path", "nosuch-org/nosuch-model",
                              "--train.output_dir", str(tmp_path / "ckpt")])
    assert_user_error(code, out, seconds, expect="train.model_path='nosuch-org/nosuch-model'")
    assert "HF_HUB_OFFLINE" in last_line(out)


def test_env_script_config_typo_names_the_key() -> None:
    code, out, seconds = run([sys.executable, "environments/gsm8k.py", "process", "--env.group_sise", "4"])
    assert_user_error(code, out, seconds, expect="did you mean 'group_size'", exit_code=2)


def test_flow_module_config_typo_exits_2() -> None:
    code, out, seconds = run([sys.executable, "-m", "flows.train", "--train.total_step", "3"])
    assert_user_error(code, out, seconds, expect="did you mean 'total_steps'", exit_code=2)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    code, out, _ = run([sys.executable, "-m", "flows.export", "sft", "--output.path", str(tmp_path / "out"),
                        "--source.store", str(tmp_path / "no-store"), "--debug"])
    assert code == 1 and "Traceback" in out and "holds no runs" in last_line(out)


def test_ctrl_c_ends_with_one_line_and_exit_130() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # 'ready' from inside the command run_cli runs: a SIGINT before run_cli is entered would be Python's own.
    script = "import time; from factory.cli_errors import run_cli; " \
             "raise SystemExit(run_cli('demo', lambda args: (print('ready', flush=True), time.sleep(60))))"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.strip() == "demo: interrupted"


def test_console_script_help_is_generated() -> None:
    code, out, seconds = run([sys.executable, "-c", "import sys; from factory.serve.cli import main; "
                              "sys.argv = ['run-api', '--help']; raise SystemExit(main())"])
    assert code == 0 and "PydanticUndefined" not in out and "--follow_runs" in out and seconds < 10


def test_second_checkout_is_refused_naming_the_first(tmp_path: Path) -> None:
    """`factory-local up` in a second checkout never reuses the first checkout's Prefect server on the same port."""
    from tests.conftest import free_port

    port = free_port()
    first, second = tmp_path / "checkout-a", tmp_path / "checkout-b"
    first.mkdir()
    second.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FACTORY_PREFECT_PORT": str(port)}
    up = [sys.executable, "-m", "factory.local_prefect", "up", "--no-worker"]
    try:
        done = subprocess.run(up, cwd=first, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        began = time.monotonic()
        refused = subprocess.run(up, cwd=second, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = last_line(refused.stderr)
        assert f"port {port} already serves the Prefect stack of another checkout ({first})" in line, line
        assert "FACTORY_PREFECT_PORT=" in line and "Traceback" not in refused.stderr
        assert time.monotonic() - began < 10
        assert not (second / ".factory" / "server.pid").exists()
        # The first checkout finds its own stack again, even without its pid file; and `env` keeps its port.
        (first / ".factory" / "server.pid").rename(first / ".factory" / "server.pid.bak")
        again = subprocess.run(up, cwd=first, env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0, again.stdout + again.stderr
        (first / ".factory" / "server.pid.bak").rename(first / ".factory" / "server.pid")
        no_port = {k: v for k, v in env.items() if k != "FACTORY_PREFECT_PORT"}
        exports = subprocess.run([sys.executable, "-m", "factory.local_prefect", "env"], cwd=first, env=no_port,
                                 capture_output=True, text=True, timeout=30).stdout
        assert f"PREFECT_API_URL='http://127.0.0.1:{port}/api'" in exports
    finally:
        subprocess.run([sys.executable, "-m", "factory.local_prefect", "down"], cwd=first, env=env, timeout=60)
