"""The local CPU policy server: SGLang's HTTP subset over any HF causal LM directory, for laptops and CI.

    python -m factory.inference.local_server --model models/starter-policy --port 30000
    factory-policy-server --model PATH --port P

Speaks /health, /v1/models, /v1/chat/completions, /v1/completions, /generate,
/update_weights_from_disk, /get_model_info and /get_weight_version, shaped like
SGLang's answers so the same client serves both. Concurrent requests share
batches on one engine thread. Every answer carries the weight version that
produced it. `start_local_server` runs it as a subprocess for tests and flows.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


def create_app(model_path: str, *, served_model_name: str | None = None, weight_version: int = 0,
               max_batch_rows: int = 64):
    """The FastAPI app; the model loads when the app starts."""
    from fastapi import FastAPI

    from factory.inference.engine import BatchingEngine, PolicyEngine
    from factory.inference.server_routes import register_routes

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = PolicyEngine(model_path, weight_version=weight_version)
        state["engine"] = BatchingEngine(engine, max_batch_rows=max_batch_rows)
        yield
        # Requests still running had the server's grace period already; the engine thread is a daemon.
        state["engine"].close(timeout=2)

    app = FastAPI(title="factory policy server", lifespan=lifespan)
    register_routes(app, state, served_model_name or Path(model_path).name)
    return app


def main(argv: list[str] | None = None) -> int:
    """`factory-policy-server --model DIR --port P`; user errors end in one line (factory/cli_errors.py)."""
    from factory.cli_errors import run_cli

    return run_cli("factory-policy-server", _main, argv)


def _main(argv: list[str]) -> int:
    from factory.cli_errors import check_port_free

    parser = argparse.ArgumentParser(description="Serve a HF causal LM on CPU with SGLang's HTTP API subset.")
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: dir name)")
    parser.add_argument("--weight-version", type=int, default=0, help="policy version of the weights loaded at start")
    parser.add_argument("--max-batch-rows", type=int, default=64, help="most sequences sampled in one batch")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS)")
    parser.add_argument("--shutdown-grace-s", type=float, default=10.0,
                        help="on SIGTERM/SIGINT, seconds requests in flight get to finish before the server exits")
    args = parser.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model!r} is not a HF model directory (no config.json); "
                     "build the starter policy with `python scripts/build_starter_policy.py`")
    check_port_free(args.host, args.port)
    import torch
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(args.model, served_model_name=args.served_model_name, weight_version=args.weight_version,
                     max_batch_rows=args.max_batch_rows)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=args.shutdown_grace_s)
    return 0


@dataclass
class ServerHandle:
    """A running local server subprocess."""

    process: subprocess.Popen
    port: int
    host: str = "127.0.0.1"
    log_path: Path | None = None
    remove_log: bool = False

    @property
    def base_url(self) -> str:
        """Root URL (SGLang native routes); the OpenAI routes live under base_url + '/v1'."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 15) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.remove_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_server(model_path: str | Path, port: int | None = None, *, wait_s: float = 120,
                        extra_args: list[str] | None = None, log_path: str | Path | None = None) -> ServerHandle:
    """Start the server as a subprocess on `port` (a free one if None) and wait for /health."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "factory.inference.local_server", "--model", str(model_path), "--port", str(port),
           *(extra_args or [])]
    temporary_log = log_path is None
    if temporary_log:
        fd, name = tempfile.mkstemp(prefix="policy-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    handle = ServerHandle(process, port, log_path=log_path, remove_log=temporary_log)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = log_path.read_text(errors="replace")[-2000:]
            handle.stop()
            raise RuntimeError(f"local policy server for {model_path} exited with code {process.returncode}: {err}")
        try:
            if httpx.get(f"{handle.base_url}/health", timeout=1).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    handle.stop()
    raise TimeoutError(f"local policy server for {model_path} on port {port} not healthy after {wait_s:.0f} s")


@contextmanager
def start_local_server(model_path: str | Path, port: int | None = None, **kwargs) -> Iterator[ServerHandle]:
    """Context manager around `launch_local_server`; stops the server on exit."""
    handle = launch_local_server(model_path, port, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


if __name__ == "__main__":
    raise SystemExit(main())
