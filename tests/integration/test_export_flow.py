"""The `sft-export` and `dpo-export` flows on a real local Prefect server: outputs and the summary artifact."""

from __future__ import annotations

import asyncio

import datasets
import pytest

from factory.export.config import DpoSelectionConfig, OutputConfig, SourceConfig
from factory.store import ShardStore
from factory.synthetic import synthetic_groups

pytestmark = pytest.mark.integration


async def _artifact(key: str, flow_run_id):
    """The run's artifacts under `key` (the session's server holds other tests' exports under the same key)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return found


def test_export_flows_write_datasets_and_a_summary_artifact(prefect_server, tmp_path):
    from flows.export import dpo_export, sft_export

    store = ShardStore(tmp_path / "store")
    store.commit("run-1", "w0", 0, list(synthetic_groups(60, env="math", run_id="run-1")))
    store.commit("run-1", "w1", 0, list(synthetic_groups(60, start=60, env="code", run_id="run-1")))
    source = SourceConfig(store=str(store.root), runs=["run-1"], envs=["math"])

    sft_state = sft_export(output=OutputConfig(path=str(tmp_path / "sft")), source=source, return_state=True)
    summary = sft_state.result()
    assert summary["groups_in"] == 60 and summary["rows_out"] > 0
    sft = datasets.load_dataset("parquet", data_dir=str(tmp_path / "sft"), split="train")
    assert sft.num_rows == summary["rows_out"] and set(sft["env"]) == {"math"}

    dpo_state = dpo_export(output=OutputConfig(path=str(tmp_path / "dpo.jsonl")), source=source,
                           select=DpoSelectionConfig(pairs_per_group=1), return_state=True)
    pairs = dpo_state.result()
    assert 0 < pairs["rows_out"] <= 60

    [artifact] = asyncio.run(_artifact("sft-export-summary", sft_state.state_details.flow_run_id))
    text = artifact.data
    assert f"| 60 | 480 | {summary['rows_out']} |" in text
    assert "not_positive_score" in text and "Score histogram" in text
    assert asyncio.run(_artifact("dpo-export-summary", dpo_state.state_details.flow_run_id))


def test_flow_refuses_to_overwrite(prefect_server, tmp_path):
    from flows.export import sft_export
    from factory.export.writer import OutputExistsError

    store = ShardStore(tmp_path / "store")
    store.commit("run-1", "w0", 0, list(synthetic_groups(5)))
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError):
        sft_export(output=OutputConfig(path=str(tmp_path / "out")), source=SourceConfig(store=str(store.root)))
