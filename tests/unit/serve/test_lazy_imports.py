"""An idle run-api (registered, nothing queued) has not imported pyarrow; the first post loads it and is stored."""

from __future__ import annotations

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
