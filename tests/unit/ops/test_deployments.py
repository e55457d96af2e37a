"""prefect.yaml: every deployment points at an importable flow by module path, with parameters the flow accepts."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from factory.local_prefect import LocalPrefect, deployment_pools

REPO = Path(__file__).resolve().parents[3]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def test_the_pools_to_create_are_every_pool_the_deployments_name(tmp_path):
    assert deployment_pools(REPO / "prefect.yaml") == ["local-process", "slurm-head"]
    assert LocalPrefect(home=REPO / ".factory").pools() == ["local-process", "slurm-head"]
    assert deployment_pools(tmp_path / "missing.yaml") == []
    (tmp_path / "prefect.yaml").write_text("deployments:\n- name: a\n  work_pool: {name: gpu}\n- name: b\n")
    assert LocalPrefect(home=tmp_path / ".factory").pools() == ["local-process", "gpu"]


def test_export_deployments_exist():
    names = {d["name"]: d["entrypoint"] for d in DEPLOYMENTS}
    assert names["sft-export"] == "flows.export:sft_export" and names["dpo-export"] == "flows.export:dpo_export"


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_entrypoint_is_a_module_path_and_parameters_are_the_flows(deployment):
    module, _, name = deployment["entrypoint"].partition(":")
    assert "/" not in module and not module.endswith(".py"), "Dask/SLURM workers import the flow by module name"
    flow = getattr(importlib.import_module(module), name)
    accepted = set(inspect.signature(flow.fn).parameters)
    parameters = deployment.get("parameters") or {}
    assert set(parameters) <= accepted, f"unknown parameters {set(parameters) - accepted}"
    if path := parameters.get("config_path"):
        assert (REPO / path).is_file()


DATAGEN = [d for d in DEPLOYMENTS if d["entrypoint"].startswith(("flows.datagen:", "flows.env_library:"))]


@pytest.mark.parametrize("deployment", DATAGEN, ids=[d["name"] for d in DATAGEN])
def test_datagen_deployment_config_resolves(deployment, monkeypatch):
    """The deployment's YAML plus its parameters validate (a typo in either fails here, not in a run)."""
    from environments.registry import BUILTIN
    from flows.datagen import build_job_config

    monkeypatch.chdir(REPO)
    flow_name = deployment["entrypoint"].split(":")[1].removesuffix("_datagen")
    parameters = dict(deployment["parameters"])
    config_path = parameters.pop("config_path")
    cfg = build_job_config(BUILTIN[flow_name], config_path=config_path, values=parameters)
    assert cfg.env.tokenizer_name, "preflight refuses token in/out sampling without the policy's tokenizer"
