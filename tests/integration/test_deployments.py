"""Every non-SLURM deployment, run the way a user runs it: `prefect deploy --all`, a process worker, a deployment run.

Sampling goes to the scripted reference policy (environments/reference_policy.py), an OpenAI-compatible server
that answers every shipped env in microseconds, so the runs cost what the factory itself costs. Deployments
that cannot run from a fresh clone here (a hub dataset while offline, the shipped judge endpoint that nothing
serves) must fail in seconds, once, with a line naming what they need.

Not run here: train-grpo, grpo-train and compact (run as deployments with a run-api and a tiny store by
tests/integration/test_trainer_deployments.py), rl-loop (test_rl_loop_flow.py), atropos-env (an Atropos venv;
test_atropos_env.py), and the SLURM deployments.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_datagen_deployment import checkout_like, client_env, prefect, process_worker

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
GROUP = 4
"""Group size of every run (the reference policy answers per group of this size)."""

# deployment -> its run's parameters; the deployment's own sections stay (they merge key by key).
DATAGEN: dict[str, dict[str, Any]] = {
    "intern-bootcamp-datagen": {"env": {"total_items": 4}, "datagen": {"chunk_items": 2}},
    "intern-bootcamp-datagen-adaptive": {"datagen": {"target_groups": 1, "max_items": 8, "chunk_items": 2}},
    "intern-bootcamp-datagen-dask": {"env": {"total_items": 4}, "datagen": {"chunk_items": 2, "dask_workers": 1,
                                                                            "dask_threads_per_worker": 2}},
    "gsm8k-sample-datagen": {"env": {"total_items": 4}},
    "tool-calling-datagen": {"env": {"total_items": 2}},
    "code-exec-datagen": {"env": {"total_items": 2}, "datagen": {"score_workers": 1}},
    "reasoning-gym-datagen": {"env": {"total_items": 4}},
    "math-sample-datagen": {"env": {"total_items": 4}},
    "multiple-choice-datagen": {"env": {"total_items": 4}},
    "blackjack-datagen": {"env": {"total_items": 2}},
    "shape-count-datagen": {"env": {"total_items": 4}},
    "chess-datagen": {"env": {"total_items": 2}},
    "chess-play-datagen": {"env": {"total_items": 2}},
    "llm-judge-datagen": {"env": {"total_items": 2}},  # the judge: the reference policy too (set below)
}
FAILS_FAST: dict[str, tuple[dict[str, Any], str]] = {
    "gsm8k-datagen": ({}, "preflight: env.dataset_name='openai/gsm8k': is a hub dataset that is not in the local cache"),
    "math-datagen": ({}, "preflight: env.dataset_name='HuggingFaceH4/MATH-500': is a hub dataset that is not in the"),
    "llm-judge-datagen": ({"env": {"total_items": 2}, "openai": "REFERENCE"},
                          "preflight: env.judge.base_url='http://127.0.0.1:30001/v1': the judge endpoint is not reachable"),
}
"""Deployments run with their shipped settings (nothing serves the judge, no hub here): one line, in seconds."""
EXPORTS = {"sft-export": "sft", "dpo-export": "dpo"}


def deployments() -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}


def flow_name(deployment: dict[str, Any]) -> str:
    return deployment["entrypoint"].split(":")[1].replace("_", "-")


def teach_reference(policy: Any, deployment: dict[str, Any], params: dict[str, Any], work: Path) -> None:
    """Give the reference policy the items this run will ask about (the env built as the run will build it)."""
    from environments.base import EnvSpec, load_env
    from environments.registry import BUILTIN
    from factory.config import merge_run_parameters
    from flows.datagen import build_job_config

    defaults = dict(deployment["parameters"])
    config_path = str(work / defaults.pop("config_path"))
    values = merge_run_parameters(defaults, {k: params.get(k) for k in ("env", "openai", "datagen", "serve")})
    ref = BUILTIN[flow_name(deployment).removesuffix("-datagen").replace("-", "_")]
    cfg = build_job_config(ref, config_path=config_path, values={k: v for k, v in values.items() if v})
    env = load_env(EnvSpec(ref, cfg.env.model_dump(mode="json")))
    items = cfg.datagen.max_items or cfg.env.total_items
    policy.add(env, [env.get_item(i) for i in range(items)])


def wait_for(client: Any, run_ids: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Poll until every run is final; returns name -> flow run."""
    deadline = time.monotonic() + timeout
    while True:
        runs = {name: client.read_flow_run(run_id) for name, run_id in run_ids.items()}
        if all(run.state is not None and run.state.is_final() for run in runs.values()) or time.monotonic() > deadline:
            return runs
        time.sleep(2)


def run_logs(client: Any, run_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)


def test_every_non_slurm_deployment_runs_or_fails_fast_saying_what_it_needs(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterName, FlowRunFilter,
                                                FlowRunFilterId, FlowRunFilterParentTaskRunId)
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.deployments import run_deployment

    from environments.reference_policy import ReferencePolicy, serve
    from factory.local_prefect import LocalPrefect
    from factory.store import ShardStore

    env, work = client_env(prefect_server), checkout_like(tmp_path)
    (work / "environments").symlink_to(REPO / "environments")  # the sample data files named in deployments/
    port = int(prefect_server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    stack = LocalPrefect(home=work / ".factory", port=port)
    started = time.monotonic()
    # What `factory-local up` does to pools (the server is the fixture's): every one prefect.yaml names, slurm-head too.
    # (Earlier tests on the session's server may have made some already: ensure_pools returns only what it made.)
    stack.ensure_pools()
    with get_client(sync_client=True) as client:
        assert {"local-process", "slurm-head"} <= {pool.name for pool in client.read_work_pools()}
    deployed = prefect("--no-prompt", "deploy", "--all", env=env, cwd=work, timeout=600)
    timings = {"deploy --all": round(time.monotonic() - started, 1)}
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    shipped = deployments()
    with get_client(sync_client=True) as client:
        # The server is the session's: earlier tests' deployments are on it too (the API's default page is 200).
        registered = {d.name for d in client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(shipped))), limit=len(shipped))}
    assert set(shipped) <= registered, set(shipped) - registered

    # --params through the CLI, the way a user types it: a section given merges into the deployment's.
    policy = ReferencePolicy(GROUP)
    worker = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "local-process", "--type", "process",
              "--limit", "4"]  # flow runs at once: each is a Python process with torch imported
    with serve(policy) as url, process_worker("local-process", env=env, cwd=work, log=tmp_path / "worker.log",
                                              argv=worker):
        openai = {"base_url": url, "server_type": "openai", "model_name": "reference-policy"}
        runs: dict[str, Any] = {}
        for name, params in DATAGEN.items():
            params = {**params, "openai": openai,
                      "env": {**params.get("env", {}), "group_size": GROUP}}
            if name == "llm-judge-datagen":
                params["env"]["judge"] = openai
            teach_reference(policy, shipped[name], params, work)
            runs[name] = run_deployment(f"{flow_name(shipped[name])}/{name}", parameters=params, timeout=0).id
        for name, (params, _) in FAILS_FAST.items():
            params = {k: openai if v == "REFERENCE" else v for k, v in params.items()}
            runs[f"{name} (shipped)"] = run_deployment(f"{flow_name(shipped[name])}/{name}", parameters=params,
                                                       timeout=0).id
        with get_client(sync_client=True) as client:
            final = wait_for(client, runs, timeout=420)
            timings["datagen runs"] = round(time.monotonic() - started, 1)
            # Exports of what intern-bootcamp-datagen wrote (./data/intern-bootcamp in the checkout).
            exports = {name: run_deployment(f"{name}/{name}", parameters={"output": {"style": "conversational"}},
                                            timeout=0).id for name in EXPORTS}
            final.update(wait_for(client, exports, timeout=180))
            timings["exports"] = round(time.monotonic() - started, 1)
            # A typo in --params, through the CLI as a user types it (the queue is empty now: no wait for a slot).
            cli_started = time.monotonic()
            typo = prefect("deployment", "run", "intern-bootcamp-datagen/intern-bootcamp-datagen", "--params",
                           json.dumps({"env": {"group_sise": 2}}), "--watch", "--watch-timeout", "120", env=env,
                           cwd=work, timeout=180)
            timings["typo run (CLI, --watch)"] = round(time.monotonic() - cli_started, 1)
            worker_log = (tmp_path / "worker.log").read_text(errors="replace")
            report = {name: (run.state.type.value, run.state.message, round(run.total_run_time.total_seconds(), 1),
                             run.run_count) for name, run in final.items()}
            print(json.dumps({"timings_s": timings, "runs": report}))

            for name in [*DATAGEN, *EXPORTS]:
                run = final[name]
                assert run.state.is_completed(), (name, report[name], worker_log[-4000:])
                # The run the user started did the work: its own task runs, no subflow, the progress on its log.
                tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
                assert tasks, f"{name}: no task runs on the deployment's run"
                children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[t.id for t in tasks])))
                assert children == [], f"{name}: a subflow carries the work"
            kept_nothing = []
            for name in DATAGEN:
                logs = run_logs(client, final[name].id)
                summary = next(json.loads(log.message.removeprefix("summary: ")) for log in logs
                               if log.message.startswith("summary: "))
                if summary["groups_kept"] == 0:  # the reference policy answers some groups all right or all wrong
                    kept_nothing.append(name)
                    assert any(log.level == 30 and log.message.startswith("0 groups kept in run ") for log in logs), name
            print(f"runs that kept 0 groups (each with its WARNING on the run): {kept_nothing}")
            for name, (_, line) in FAILS_FAST.items():
                run = final[f"{name} (shipped)"]
                assert run.state.is_failed() and run.run_count == 1, (name, report[f"{name} (shipped)"])
                assert run.total_run_time.total_seconds() < 30, report[f"{name} (shipped)"]
                assert line in (run.state.message or ""), report[f"{name} (shipped)"]

    # The typo: failed once (no retries), the key and a suggestion on the run, within seconds.
    assert typo.returncode != 0 and "Failed" in typo.stdout, typo.stdout[-2000:]
    assert timings["typo run (CLI, --watch)"] < 90, timings
    with get_client(sync_client=True) as client:
        # Newest runs of that deployment only: the session's server holds every earlier test's runs too.
        recent = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["intern-bootcamp-datagen"])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=10)
        typo_run = next(r for r in recent if r.parameters.get("env") == {"group_sise": 2})
        assert typo_run.run_count == 1 and "group_sise" in (typo_run.state.message or ""), typo_run.state

    store = ShardStore(work / "data")
    assert store.verify("intern-bootcamp") == []
    # The run's `env: {total_items: 4}` merged into the deployment's `env: {group_size: 16, total_items: 1000}`.
    groups = list(store.iter_groups("intern-bootcamp"))
    assert groups and all(g.group_size == GROUP for g in groups)
    assert any((work / "exports" / f"{kind}-intern-bootcamp").iterdir() for kind in EXPORTS.values())
