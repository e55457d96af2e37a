"""Config errors name the file; progress line; graceful stop; owner file crashes a dead owner's runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from factory.config import ConfigError
from factory.progress import ChunkProgress, format_duration
from factory.run_control import RunOwner
from factory.shutdown import GracefulStop

REF = "environments.intern_bootcamp:InternBootcampEnv"


def test_yaml_typo_names_the_file_and_the_key(tmp_path):
    from flows.datagen import build_job_config

    config = tmp_path / "job.yaml"
    config.write_text("env:\n  group_sze: 8\ndatagen:\n  chunk_items: many\n")
    with pytest.raises(ConfigError) as error:
        build_job_config(REF, config_path=str(config))
    message = str(error.value)
    assert f"unknown config key 'env.group_sze' (did you mean 'group_size'?) (in config file {config})" in message
    assert f"config key 'datagen.chunk_items'" in message and message.count(str(config)) == 2
    with pytest.raises(ConfigError, match=r"'env.group_sze'.*\(from the command line\)"):
        build_job_config(REF, cli_args=["--env.group_sze", "8"])
    with pytest.raises(ConfigError, match=r"\(from the flow parameters\)"):
        build_job_config(REF, values={"env": {"group_sze": 8}})


def test_progress_line_has_chunks_groups_rate_and_eta():
    now = [0.0]
    progress = ChunkProgress("bootcamp", total_chunks=10, done_before=2, clock=lambda: now[0])
    assert progress.line() == "bootcamp: 2/10 chunks, 0 groups kept, resumed, ETA ?"
    now[0] = 20.0
    assert progress.update(groups_kept=40, rollouts=640) == "bootcamp: 3/10 chunks, 40 groups kept, 32.0 rollouts/s, ETA 2m20s"
    now[0] = 40.0
    for _ in range(7):
        line = progress.update(groups_kept=1, rollouts=0)
    assert line.endswith("10/10 chunks, 47 groups kept, 16.0 rollouts/s, done")
    assert format_duration(3725) == "1h02m"


def test_target_run_progress_counts_groups_and_says_the_target_was_reached():
    now = [0.0]
    progress = ChunkProgress("bootcamp", total_chunks=15, target_groups=20, clock=lambda: now[0])
    assert progress.line() == "bootcamp: 0/20 groups of target, 0/15 chunks, ETA ?"
    now[0] = 10.0
    assert progress.update(groups_kept=5, rollouts=80) == \
        "bootcamp: 5/20 groups of target, 1/15 chunks, 8.0 rollouts/s, ETA 30s"
    now[0] = 20.0
    line = progress.update(groups_kept=15, rollouts=240)
    assert line == "bootcamp: target of 20 groups reached (100%), 2/15 chunks, 16.0 rollouts/s, done"
    assert progress.target_reached and "ETA" not in line
    resumed = ChunkProgress("bootcamp", total_chunks=15, done_before=4, groups_before=20, target_groups=20)
    assert resumed.line() == "bootcamp: target of 20 groups reached (100%), 4/15 chunks, resumed, done"


def test_target_reached_marks_the_progress_artifact_100_percent(monkeypatch):
    import prefect.artifacts

    from factory.datagen.ops import RunOps

    updates = []
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda artifact_id, progress, description=None:
                        updates.append((artifact_id, progress, description)))
    ops = RunOps.__new__(RunOps)
    ops.logger, ops.target_groups, ops._progress_artifact, ops.progress = _Lines(), 10, "artifact-1", None
    ops.track("bootcamp", total_chunks=5, done_before=0)
    ops.chunk_committed(groups_kept=6, rollouts=48)
    assert updates == []
    ops.chunk_committed(groups_kept=4, rollouts=32)
    assert updates == [("artifact-1", 100.0, "bootcamp: target of 10 groups reached")]
    assert "target of 10 groups reached (100%)" in ops.logger.lines[-1]


def test_a_progress_artifact_made_after_the_target_was_reached_says_100_percent(monkeypatch):
    """The artifact is made after `track` now (once the first task run is out, or at the end of a run with nothing
    left to do): a resumed run whose target was already reached still shows 100%."""
    import prefect.artifacts

    from factory.datagen.ops import RunOps

    updates = []
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda progress, key, description: "artifact-2")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda artifact_id, progress, description=None: updates.append((artifact_id, progress)))
    ops = RunOps.__new__(RunOps)
    ops.logger, ops.target_groups, ops._progress_artifact, ops.progress = _Lines(), 10, None, None
    ops.report_run = None
    ops.track("bootcamp", total_chunks=5, done_before=3, groups_before=12)
    assert updates == []  # no artifact yet
    assert ops.progress_artifact(60.0, key="k", description="d") == "artifact-2"
    assert updates == [("artifact-2", 100.0)]


class _Lines:
    def __init__(self):
        self.lines = []

    def info(self, message, *args):
        self.lines.append(message % args if args else message)


def test_sigterm_sets_the_stop_flag_and_starts_the_grace_clock():
    stop = GracefulStop(grace_s=100)
    with stop:
        assert not stop.requested and stop.remaining() == float("inf")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.signal_name == "SIGTERM" and 99 < stop.remaining() <= 100
        stop.disarm()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_watchdog_exits_the_process_after_the_grace_period():
    script = ("import time; from factory.shutdown import GracefulStop\n"
              "s = GracefulStop(grace_s=0.5, on_abandon=lambda why: print('abandon:', why, flush=True))\n"
              "s.__enter__(); print('ready', flush=True)\n"
              "while True: time.sleep(0.1)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert process.stdout.readline().strip() == "ready"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert process.returncode == 128 + signal.SIGTERM
    assert "abandon: grace period of 0.5s after SIGTERM ran out" in out
    assert elapsed < 0.5 + 3 + 4  # grace + the watchdog's margin + a loaded machine


def test_owner_file_crashes_runs_of_a_dead_owner_and_refuses_a_live_one(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("factory.run_control.set_state", lambda ids, state, msg, **kw: calls.append((ids, state)) or ids)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = RunOwner(tmp_path / "run", "prod")
    owner.path.parent.mkdir()
    owner.path.write_text(f'{{"host": "{socket.gethostname()}", "pid": {dead.pid}, "flow_runs": ["a", "b"]}}')
    assert owner.claim(["c"]) == ["a", "b"] and calls == [(["a", "b"], "Crashed")]
    assert owner.read()["pid"] == os.getpid() and owner.read()["flow_runs"] == ["c"]
    owner.release()
    assert owner.read() is None

    from factory.preflight import PreflightError

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        owner.path.write_text(f'{{"host": "{socket.gethostname()}", "pid": {alive.pid}, "flow_runs": ["x"]}}')
        with pytest.raises(PreflightError, match=f"already being written by pid {alive.pid}"):
            owner.claim(["y"])
    finally:
        alive.kill()
        alive.wait()
