"""An idle run-api (registered, nothing queued) has not imported pyarrow; the first post loads it and is stored."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from factory.serve import numjson

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from factory.serve.app import create_app
    from factory.serve.config import ServeConfig
    from factory.serve.service import BatchService

    REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=8, max_token_len=64, checkpoint_dir="c",
                        save_checkpoint_interval=5, starting_step=0, num_steps=10)

    async def main():
        config = ServeConfig(store_root=sys.argv[1], follow_interval_s=0.05)
        service = BatchService(config)
        create_app(config, service)
        await service.start()
        await service.register(REGISTRATION)
        assert (await service.next_batch(False)).raw == b'{"batch":null}'
        service.register_env(dict(max_token_length=64, desired_name="e", weight=1.0, group_size=2))
        service.status()
        await asyncio.sleep(0.2)  # a few follower scans
        idle = sorted(m for m in ("pyarrow", "numpy", "factory.store") if m in sys.modules)
        from factory.serve.wire import decode_groups
        body = b'{"tokens": [[1, 2], [3, 4]], "masks": [[1, 1], [1, 1]], "scores": [1.0, 0.0]}'
        stored = await service.ingest_wire(decode_groups(body, many=False, build=True, run_id="api"))
        await service.stop()
        print(idle, stored)

    asyncio.run(main())
    """
)


def test_idle_service_has_not_imported_pyarrow_and_the_first_post_is_stored(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "1"]


def test_without_a_built_numjson_bodies_go_the_msgspec_way(monkeypatch, caplog):
    monkeypatch.setattr(numjson, "built_library", lambda: None)
    assert numjson._load() is None
    assert "not built at install time" in caplog.text


FIRST_BATCH = textwrap.dedent(
    """
    import asyncio, gzip, json, sys
    from factory.serve.cli import _Refused
    from factory.serve.config import ServeConfig
    from factory.serve.service import BatchService
    from factory.serve.wire import decode_groups

    sys.meta_path.insert(0, _Refused(["pandas"]))  # as run-api does: pyarrow would import it, and it pyarrow.compute

    REGISTRATION = dict(wandb_group="g", wandb_project="p", batch_size=4, max_token_len=64, checkpoint_dir="c",
                        save_checkpoint_interval=5, starting_step=0, num_steps=10)

    async def main():
        service = BatchService(ServeConfig(store_root=sys.argv[1], follow_interval_s=0.05))
        await service.start()
        await service.register(REGISTRATION)
        service.register_env(dict(max_token_length=64, desired_name="e", weight=1.0, group_size=2))
        for score, logprobs in ((1.0, "[[-0.5, -1.25e-3], [0.1, -2]]"), (0.0, "null")):
            body = ('{"tokens": [[1, 2], [3, 4]], "masks": [[1, 1], [1, 1]], "scores": [%s, 0.5], '
                    '"inference_logprobs": %s}' % (score, logprobs)).encode()
            await service.ingest_wire(decode_groups(body, many=False, build=True, run_id="api"))
        body = await service.next_batch(True)
        batch = json.loads(body.raw if body.raw is not None else gzip.decompress(bytes(body.gz)))["batch"]
        await service.stop()
        print(json.dumps([group["inference_logprobs"] for group in batch]))
        print(sorted(m for m in ("pyarrow.compute", "pydoc") if m in sys.modules))

    asyncio.run(main())
    """
)


def test_the_first_post_and_batch_do_not_import_pyarrow_compute(tmp_path):
    """pyarrow.compute builds a wrapper per Arrow function when imported (~20 ms of CPU, ~1.4 MiB of RSS kept):
    the float cast and the null rows of a batch are reached without it."""
    result = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    logprobs, imported = result.stdout.splitlines()
    assert sorted(json.loads(logprobs), key=str) == sorted([[[-0.5, -0.00125], [0.1, -2.0]], None], key=str)
    assert imported == "[]"


REFUSED = textwrap.dedent(
    """
    import json, sys
    from factory.serve.cli import _Refused, _refused_modules
    from factory.serve.config import ServeConfig

    local = _refused_modules(ServeConfig(store_root=sys.argv[1]))
    s3 = _refused_modules(ServeConfig(store_root="s3://bucket/store", state_path=sys.argv[1] + "/state.sqlite"))
    sys.meta_path.insert(0, _Refused(local))
    import pyarrow.fs, pyarrow.parquet
    loaded = [m for m in ("pyarrow._s3fs", "pyarrow._gcsfs", "pyarrow._azurefs", "pyarrow._hdfs") if m in sys.modules]
    print(json.dumps([sorted(local), sorted(s3), hasattr(pyarrow.fs, "LocalFileSystem"), loaded]))
    """
)


def test_run_api_refuses_the_cloud_file_systems_it_does_not_use(tmp_path):
    """pyarrow.parquet loads every cloud file system pyarrow was built with (S3's library alone ~2.7 MiB of RSS);
    run-api refuses them, and S3 only when its store is not on S3; pyarrow.parquet works without them."""
    result = subprocess.run([sys.executable, "-c", REFUSED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    local, s3, has_local_fs, loaded = json.loads(result.stdout)
    cloud = ["pyarrow._azurefs", "pyarrow._gcsfs", "pyarrow._hdfs"]
    assert local == sorted(["pandas", *cloud, "pyarrow._s3fs"])
    assert s3 == sorted(["pandas", *cloud])
    assert has_local_fs and loaded == []
