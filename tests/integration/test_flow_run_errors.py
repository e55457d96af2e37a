"""A flow run that fails on a user error: Failed, and its log says why in one line, without Prefect's tracebacks."""

from __future__ import annotations

import asyncio
import time

import pytest


def test_a_user_error_fails_the_run_with_one_log_line(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from factory.train.rl_plan import LoopInputError
    from flows.rl_loop import rl_loop

    state = rl_loop(loop={"policy": str(tmp_path / "no-policy"), "out_dir": str(tmp_path / "out")},
                    return_state=True)
    assert state.is_failed()
    with pytest.raises(LoopInputError):
        state.result()

    async def messages() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[state.state_details.flow_run_id])))
            return [log.message for log in logs]

    deadline = time.monotonic() + 15  # logs reach the API in batches
    lines = asyncio.run(messages())
    while not any(line.startswith("Finished in state") for line in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.5)
        lines = asyncio.run(messages())
    failed = [line for line in lines if line.startswith("flow run failed: ")]
    assert len(failed) == 1 and "starter policy missing" in failed[0], lines
    assert not any("Traceback" in line for line in lines), lines


def test_compact_on_an_empty_store_warns_and_a_missing_run_fails_with_one_line(prefect_server, tmp_path):
    from factory.store import StoreError
    from flows.compact import compact

    started = time.monotonic()
    assert compact(str(tmp_path / "store")) == []
    state = compact(str(tmp_path / "store"), runs=["no-such-run"], return_state=True)
    assert state.is_failed()
    with pytest.raises(StoreError, match=r"run\(s\) \['no-such-run'\] have no commit log"):
        state.result()
    assert time.monotonic() - started < 20


def test_the_flow_run_process_a_worker_starts_prints_one_line_not_a_traceback(prefect_server, tmp_path):
    """What a process worker runs for a deployment run (`python -m prefect.engine`), on a user error. The flow is
    loaded by module path, as prefect.yaml's entrypoints are (importing `flows` installs the one-line filter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType

    from flows.rl_loop import rl_loop

    repo = Path(__file__).resolve().parents[2]
    deployment_id = rl_loop.to_deployment(name="one-line-check", entrypoint_type=EntrypointType.MODULE_PATH).apply()
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            deployment_id, parameters={"loop": {"policy": str(tmp_path / "no-policy")}})
    env = {**os.environ, **prefect_server, "PREFECT__FLOW_RUN_ID": str(run.id), "PYTHONPATH": str(repo),
           "FACTORY_DEBUG": ""}
    done = subprocess.run([sys.executable, "-m", "prefect.engine"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "flow run failed: starter policy missing" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run.id).state.is_failed()
