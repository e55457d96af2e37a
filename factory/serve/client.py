"""Small Atropos-protocol clients and a `run-api` process handle, for tests, benchmarks and scripts.

`EnvClient` talks like an Atropos environment (register-env, gzip-compressed
/scored_data(_list) posts, GET /status-env with a JSON body); `TrainerClient`
like an Atropos trainer (/register, poll /batch). `ApiProcess` starts any
`run-api`-style command, waits until it answers and stops it.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import orjson

GZIP_MIN_BYTES = 1024
"""Atropos's env client gzips bodies of at least this size."""


class ApiProcess:
    """A batching-API server in a child process (ours or atroposlib's run-api)."""

    def __init__(self, command: Sequence[str], port: int, *, env: dict[str, str] | None = None, log_path: str | None = None) -> None:
        self.command, self.port = list(command), port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0, headers: dict[str, str] | None = None) -> ApiProcess:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{' '.join(self.command)} exited with {self.process.returncode}; see {self.log_path}")
            try:
                httpx.get(self.url + "/", timeout=1.0, headers=headers)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{' '.join(self.command)} did not answer on {self.url} within {timeout} s")

    def kill9(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def __enter__(self) -> ApiProcess:
        # `with ApiProcess(...).start() as api` must not start a second server (the first would outlive the block).
        if self.process is not None and self.process.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def encode_body(payload: Any) -> tuple[bytes, dict[str, str]]:
    """JSON body gzipped as Atropos's env client does it (only when big enough and smaller)."""
    body = orjson.dumps(payload)
    headers = {"Content-Type": "application/json"}
    if len(body) >= GZIP_MIN_BYTES:
        compressed = gzip.compress(body)
        if len(compressed) < len(body):
            headers["Content-Encoding"] = "gzip"
            body = compressed
    return body, headers


class EnvClient:
    """An Atropos-protocol environment."""

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
        self.http = httpx.Client(base_url=url, headers=headers or {}, timeout=timeout)
        self.env_id: int | None = None

    def register(self, name: str, group_size: int, *, weight: float = 1.0, max_token_length: int = 2048,
                 min_batch_allocation: float | None = None, wait_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + wait_s
        while True:
            data = self.http.post("/register-env", json={
                "max_token_length": max_token_length, "desired_name": name, "weight": weight,
                "group_size": group_size, "min_batch_allocation": min_batch_allocation,
            }).json()
            if data["status"] == "success":
                self.env_id = data["env_id"]
                return data
            if time.monotonic() > deadline:
                raise TimeoutError(f"env {name!r} could not register: {data}")
            time.sleep(0.2)

    def post(self, groups: list[dict[str, Any]], *, retries: int = 0, retry_wait_s: float = 0.5,
             idempotency_key: str | None = None) -> httpx.Response:
        """Post one group (/scored_data) or several (/scored_data_list), tagged with this env's id.

        Every post carries an Idempotency-Key (reused on each retry), so a post
        retried after a lost acknowledgement is stored once. With `retries`,
        connection errors and 5xx answers are retried (honouring Retry-After).
        """
        items = [{**group, "env_id": self.env_id} for group in groups]
        path, payload = ("/scored_data", items[0]) if len(items) == 1 else ("/scored_data_list", items)
        body, headers = encode_body(payload)
        headers["Idempotency-Key"] = idempotency_key or uuid.uuid4().hex
        for attempt in range(retries + 1):
            try:
                reply = self.http.post(path, content=body, headers=headers)
            except httpx.TransportError:
                if attempt == retries:
                    raise
                time.sleep(retry_wait_s)
                continue
            if reply.status_code < 500 or attempt == retries:
                return reply
            time.sleep(float(reply.headers.get("retry-after", retry_wait_s)))
        raise AssertionError("unreachable")

    def status(self) -> dict[str, Any]:
        return self.http.request("GET", "/status-env", json={"env_id": self.env_id}).json()


class TrainerClient:
    """An Atropos-protocol trainer: registers, then polls /batch."""

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
        self.http = httpx.Client(base_url=url, headers=headers or {}, timeout=timeout)

    def register(self, batch_size: int, *, starting_step: int = 0, max_token_len: int = 2048, num_steps: int = 1000) -> dict[str, Any]:
        return self.http.post("/register", json={
            "wandb_group": "factory", "wandb_project": "factory", "batch_size": batch_size,
            "max_token_len": max_token_len, "checkpoint_dir": "", "save_checkpoint_interval": -1,
            "starting_step": starting_step, "num_steps": num_steps,
        }).json()

    def batch(self) -> list[dict[str, Any]] | None:
        return self.http.get("/batch").json()["batch"]
