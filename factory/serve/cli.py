"""`run-api`: serve Atropos's batching API from the shard store (drop-in for atroposlib's run-api)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import uvicorn

from factory.cli_errors import check_port_free, run_cli
from factory.preflight import check_store_writable
from factory.config import build_config, config_help, split_config_path, wants_help
from factory.serve.app import create_app
from factory.serve.config import ServeConfig
from factory.serve.recycle import (
    RecyclePolicy, exec_again, heavy_modules_loaded, last_recycle_at, listening_socket, take_handover, was_recycled,
)
from factory.serve.service import BatchService

logger = logging.getLogger(__name__)

TOKEN_ENV = "FACTORY_API_TOKEN"
"""Environment variable that sets api_token without putting it on the command line."""


def load_config(args: Sequence[str], values: dict | None = None) -> ServeConfig:
    """YAML (--config) < `values` < dotted CLI overrides; Atropos's `--reload` is accepted and ignored."""
    args = [arg for arg in args if arg != "--reload"]
    path, rest = split_config_path(args)
    values = dict(values or {})
    if os.environ.get(TOKEN_ENV):
        values.setdefault("api_token", os.environ[TOKEN_ENV])
    return build_config(ServeConfig, yaml_path=path, cli_args=rest, values=values)


def run_service(config: ServeConfig, *, stop_after_steps: int | None = None, max_runtime_s: float | None = None) -> dict[str, Any]:
    """Serve until stopped: after `stop_after_steps` trainer steps, `max_runtime_s`, or a signal; returns final status.

    This is what the Prefect flow runs; it works from a worker thread too
    (uvicorn then leaves signal handling to the main thread).
    """
    service = BatchService(config)
    app = create_app(config, service)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                                           access_log=False, timeout_graceful_shutdown=config.shutdown_grace_s))
    started = time.monotonic()

    async def watch() -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
            if stop_after_steps is not None and service.step >= stop_after_steps:
                server.should_exit = True
            if max_runtime_s is not None and time.monotonic() - started >= max_runtime_s:
                server.should_exit = True

    async def main() -> dict[str, Any]:
        watcher = asyncio.create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()
        status = service.final_status if service.final_status is not None else service.status()
        return {**status, "seconds": round(time.monotonic() - started, 2), "port": config.port}

    result = asyncio.run(main())
    logger.info("batching API stopped: %s", result)
    return result


class RecyclingServer(uvicorn.Server):
    """uvicorn's server that, once `policy` says so, stops serving as at a SIGTERM with `service.recycling` set: the
    process is to start again in place (factory/serve/recycle.py)."""

    def __init__(self, config: uvicorn.Config, service: BatchService, policy: RecyclePolicy) -> None:
        super().__init__(config)
        self.service, self.policy = service, policy

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and counter % 2 == 0 and self.policy.due(
            quiet=lambda: self.service.quiet(self.policy.idle_s, self.policy.min_interval_s),
            requests_in_flight=len(self.server_state.tasks), heavy_loaded=heavy_modules_loaded(),
        ):
            logger.info("idle after work: starting again in place to give back what the work loaded")
            self.service.recycling = self.should_exit = True
        return await super().on_tick(counter)


def serve(config: ServeConfig, *, may_recycle: bool = False) -> None:
    """Run the service until interrupted: SIGINT/SIGTERM stop taking connections, give requests in flight
    `shutdown_grace_s`, then commit (fsync) pending posted groups, close the served state and exit.

    `may_recycle` (run-api's own process only: the exec runs its command line again): idle after work, it does the
    same and then execs itself in place (`recycle_idle_s`)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handover = take_handover() if was_recycled() else None
    listener = listening_socket(config.host, config.port)
    service = BatchService(config, handover)
    app = create_app(config, service)
    server = RecyclingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False,
                       timeout_graceful_shutdown=config.shutdown_grace_s),
        service, RecyclePolicy(config.recycle_idle_s if may_recycle else 0.0, config.recycle_min_interval_s,
                               last_recycle_at()),
    )
    server.run(sockets=[listener.dup()])  # uvicorn closes the socket it is given at shutdown; `listener` stays open
    if service.recycling:
        exec_again(listener, service.handover)
    listener.close()


class _Refused:
    """Modules a library the service uses would load, that the service never uses: refused, that library goes on
    without them (each import is in a try/except ImportError there).

    - pandas: pyarrow imports it on its first pa.array() call (to recognise pandas objects): in the first post after
      a start, ~1 s of CPU and ~35 MiB of RSS.
    - pyarrow's cloud file systems: pyarrow.parquet imports pyarrow.fs, which loads each one pyarrow was built with;
      S3's library alone is ~2.7 MiB of RSS, ~3.3 MiB with the others' modules (bench/RESULTS.md, issue 29). The
      store reads s3:// through pyarrow's S3 file system, so S3 is refused only when store_root is not a URL."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in self.names or name.split(".", 1)[0] in self.names:
            raise ModuleNotFoundError(f"run-api does not load {name}", name=name)


def _refused_modules(config: ServeConfig) -> list[str]:
    """What run-api refuses to load for `config` (see `_Refused`); nothing already loaded."""
    names = ["pandas", "pyarrow._gcsfs", "pyarrow._azurefs", "pyarrow._hdfs"]
    if config.local_store_root is not None:
        names.append("pyarrow._s3fs")
    return [name for name in names if name not in sys.modules]


def _main(argv: list[str]) -> int:
    if wants_help(argv):
        print(config_help(ServeConfig, prog="run-api", description=__doc__.strip(),
                          extra_options=[("--reload", "Accepted and ignored (Atropos's run-api takes it)."),
                                         (f"${TOKEN_ENV}", "Sets api_token without putting it on the command line.")]))
        return 0
    config = load_config(argv)
    config.resolved_state_path()  # an object store URL needs a local state_path
    # The two faults a user meets first, checked before uvicorn (whose own report ends in shutdown lines).
    if not was_recycled():  # (a recycled run-api holds its port already)
        check_port_free(config.host, config.port)
    check_store_writable("store_root", config.store_root)
    refused = _refused_modules(config)
    if refused:
        sys.meta_path.insert(0, _Refused(refused))
    serve(config, may_recycle=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`run-api [--config serve.yaml] [--port 8000] [--store_root ./data] [--<key> value ...]`; --help lists every key."""
    return run_cli("run-api", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
