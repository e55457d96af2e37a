"""run-api, export and the viewer over a store on an S3-compatible object store (a local moto server started and
stopped by the test): what users rely on is the same as on a local store."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from factory.serve.config import ServeConfig
from factory.serve.service import BatchService
from factory.store import ShardStore
from factory.store_object import open_store
from factory.synthetic import synthetic_groups
from tests.moto_s3 import bucket, no_credentials, s3_endpoint  # noqa: F401 - fixtures

REGISTRATION = dict(
    wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64,
    checkpoint_dir="ckpt", save_checkpoint_interval=5, starting_step=0, num_steps=1000,
)


def _ids(body: bytes) -> list[str]:
    data = orjson.loads(body)
    return [item["group_id"] for item in data["batch"]] if data.get("batch") else []


async def _drain(service: BatchService, expected: int, timeout_s: float = 20.0) -> list[str]:
    """Batches until `expected` groups were served (or the time is up); the served ids in order."""
    served: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(served) < expected and loop.time() < deadline:
        ids = _ids((await service.next_batch(False)).raw)
        if not ids:
            await asyncio.sleep(0.05)
        served += ids
    return served


def test_run_api_follows_an_object_store_and_serves_each_group_once(bucket, tmp_path):
    _, name = bucket
    url = f"s3://{name}/store"
    writer = open_store(url)
    groups = list(synthetic_groups(64, group_size=2, seq_len=8, env="e"))
    writer.commit("gen", "w0", 0, groups[:16])
    config = ServeConfig(store_root=url, state_path=str(tmp_path / "state.sqlite"), follow_runs=["gen"],
                         follow_interval_s=0.05, batch_metadata=True)

    async def first_life() -> list[str]:
        service = BatchService(config)
        await service.start()
        await service.register(REGISTRATION)
        served = await _drain(service, 16)
        # Commits while the service runs, from two producers (two datagen workers): the follower picks them up.
        await asyncio.to_thread(writer.commit, "gen", "w0", 1, groups[16:24])
        await asyncio.to_thread(open_store(url).commit, "gen", "w1", 0, groups[24:32])
        served += await _drain(service, 16)
        # Groups posted to the API are committed to the object store too, and served once.
        await service.ingest(groups[32:40])
        served += await _drain(service, 8)
        await service.stop()
        return served

    async def second_life() -> list[str]:  # a restart with the same served state, then more commits
        service = BatchService(config)
        await service.start()
        served = await _drain(service, 0)
        assert service.queue.groups == 0
        await asyncio.to_thread(writer.commit, "gen", "w0", 2, groups[40:64])
        served += await _drain(service, 24)
        await asyncio.sleep(0.3)  # several more follower polls: nothing comes back
        served += _ids((await service.next_batch(False)).raw)
        await service.stop()
        return served

    first = asyncio.run(first_life())
    second = asyncio.run(second_life())
    served = first + second
    assert len(served) == len(set(served)) == 64
    assert set(served) == {g.group_id for g in groups}
    assert "api" in open_store(url).runs()  # the ingest run lives in the bucket; the served state stays local
    assert not Path(tmp_path / "s3:").exists()


def _same_store(local: ShardStore, url: str) -> None:
    """The same commits, in the same order, to a local store and an object store."""
    remote = open_store(url)
    for run, producer, chunk, groups in [
        ("run-a", "w0", 0, list(synthetic_groups(40, env="math", run_id="run-a"))),
        ("run-a", "w1", 0, list(synthetic_groups(40, start=40, env="code", run_id="run-a"))),
        ("run-b", "w0", 0, list(synthetic_groups(30, start=100, env="math", run_id="run-b"))),
        ("run-b", "w0", 1, list(synthetic_groups(30, start=200, env="code", run_id="run-b"))),
    ]:
        local.commit(run, producer, chunk, groups)
        remote.commit(run, producer, chunk, groups)


@pytest.mark.parametrize("kind, extra", [
    ("sft", ["--save-top-n-per-group", "2", "--save-messages"]),
    ("dpo", ["--save-messages"]),
    ("sft", ["--run", "run-b", "--layout", "trl", "--env", "code"]),
])
def test_export_from_an_object_store_matches_the_same_store_on_disk(bucket, tmp_path, kind, extra):
    from factory.cli_errors import run_cli
    from factory.export.cli import main

    _, name = bucket
    local = ShardStore(tmp_path / "local")
    _same_store(local, f"s3://{name}/store")
    outputs = []
    for label, root in (("local", str(local.root)), ("s3", f"s3://{name}/store")):
        out = tmp_path / f"{label}.jsonl"
        assert run_cli(f"atropos-{kind}-gen", lambda argv: main(kind, argv), [str(out), "--store", root, *extra, "--quiet"]) == 0
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) > 10


def _copy_to_object_store(local: ShardStore, url: str) -> None:
    import pyarrow.parquet as pq

    remote = open_store(url)
    for run in local.runs():
        for record in local.committed(run).values():
            table = pq.read_table(local.shard_path(run, record.physical))
            remote.commit(run, record.producer, record.chunk, table, row_group_groups=4)


def test_viewer_shows_the_same_groups_from_an_object_store(bucket, tmp_path):
    import re

    from starlette.testclient import TestClient

    from factory.viewer.app import ViewerConfig, create_app
    from tests.unit.viewer.store_fixture import make_viewer_store

    _, name = bucket
    local = make_viewer_store(tmp_path / "store")
    url = f"s3://{name}/viewer"
    _copy_to_object_store(local, url)
    pages = {}
    for label, root in (("local", str(local.root)), ("s3", url)):
        client = TestClient(create_app(ViewerConfig(store=root, background_index=False)))
        run_page = client.get("/run/run-1")
        assert run_page.status_code == 200
        links = re.findall(r'href="(/run/run-1/group/[0-9a-f]+)"', run_page.text)
        group_page = client.get(links[0])
        assert group_page.status_code == 200
        older = client.get("/run/run-1?offset=50").text
        pages[label] = (links, re.findall(r'href="(/run/run-1/group/[0-9a-f]+)"', older), group_page.text.count('class="completion"'),
                        "Question 59" in run_page.text, client.get("/").status_code)
    assert pages["local"] == pages["s3"] and len(pages["s3"][0]) == 50


def _cli_commands(url: str, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "run-api": [sys.executable, "-m", "factory.serve.cli", "--store_root", url, "--state_path", str(tmp_path / "state.sqlite"),
                    "--port", "0"],
        "atropos-sft-gen": [sys.executable, "-c", "from factory.export.cli import sft_main; sft_main()", str(tmp_path / "o.jsonl"),
                            "--store", url, "--save-messages"],
        "view-run": [sys.executable, "-m", "factory.viewer", "--store", url, "--port", "0"],
    }


def _one_line_failure(command: list[str], prog: str, env: dict[str, str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"{prog}:"), lines[0]
    return lines[0]


def test_missing_credentials_fail_each_cli_with_one_line(no_credentials, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    for prog, command in _cli_commands("s3://some-bucket/store", tmp_path).items():
        line = _one_line_failure(command, prog, env)
        assert "no credentials for store s3://some-bucket/store" in line and "AWS_ACCESS_KEY_ID" in line, line


def test_a_missing_bucket_fails_each_cli_with_one_line(bucket, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    for prog, command in _cli_commands("s3://no-such-bucket/store", tmp_path).items():
        line = _one_line_failure(command, prog, env)
        assert "bucket 'no-such-bucket'" in line and "does not exist" in line, line


def test_run_api_on_an_object_store_asks_for_a_local_state_path(bucket, capsys):
    from factory.serve.cli import main

    assert main(["--store_root", f"s3://{bucket[1]}/store", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "state_path" in err, err


def test_a_damaged_shard_object_is_left_out_of_serving_and_the_rest_served(bucket, tmp_path):
    fs, name = bucket
    url = f"s3://{name}/store"
    store = open_store(url)
    groups = list(synthetic_groups(30, group_size=2, seq_len=8, env="e"))
    for chunk in range(3):
        store.commit("gen", "w0", chunk, groups[chunk * 10:(chunk + 1) * 10])
    record = store.record("gen", "w0-00000001.parquet")
    with fs.open_output_stream(store.shard_path("gen", record.shard)) as out:  # same size, not Parquet
        out.write(b"x" * record.bytes)
    config = ServeConfig(store_root=url, state_path=str(tmp_path / "state.sqlite"), follow_runs=["gen"],
                         follow_interval_s=0.05, batch_metadata=True)

    async def scenario() -> list[str]:
        service = BatchService(config)
        await service.start()
        await service.register(REGISTRATION)
        served = await _drain(service, 20, timeout_s=5)
        await asyncio.sleep(0.2)  # more polls: the damaged shard stays out
        served += _ids((await service.next_batch(False)).raw)
        await service.stop()
        return served

    served = asyncio.run(scenario())
    assert sorted(served) == sorted(g.group_id for g in groups[:10] + groups[20:])
