"""An instant SGLang/OpenAI-shaped HTTP server that injects faults on purpose: 5xx, 429, slow answers, resets.

A test double for the client's fault handling and the "instant server" of the
client-overhead benchmark. It is a real HTTP/1.1 server on a real socket
(asyncio, keep-alive), so the client's transport, timeouts and reconnects are
exercised for real. Faults are queued per server and consumed one per
sampling request; `down=True` fails everything (health included) until cleared.

    python -m factory.inference.fault_server --port 31000     # serve instantly, no faults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections import Counter, deque
from typing import Any

SAMPLING_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable"}


class FaultServer:
    """Serve on 127.0.0.1:`port` from a background thread (start/stop) or in the caller's loop (serve_forever)."""

    def __init__(self, port: int = 0, *, max_n: int | None = None, output_len: int = 4, delay_s: float = 0.0) -> None:
        self.port = port
        self.delay_s = delay_s  # every sampling answer takes this long (a run that lasts long enough to be disturbed)
        self.max_n = max_n  # return at most this many choices (a server that caps or ignores n)
        self.output_len = output_len
        self.faults: deque[str] = deque()  # "500", "503", "429", "reset", "slow:<seconds>", "abort"
        self.down = False
        self.weight_version = 0
        self.hits: Counter[str] = Counter()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, *faults: str) -> None:
        self.faults.extend(faults)

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> FaultServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.open())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fault-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None or self._server is None or not self._loop.is_running():
            return

        async def close() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            try:  # handlers still sleeping (delay_s, slow:) hold wait_closed on newer Pythons; their sockets are gone
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except TimeoutError:
                pass

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- HTTP --------------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.hits[path] += 1
                status, payload = await self._route(method, path, body)
                if status < 0:  # reset: drop the connection without answering
                    writer.transport.abort()
                    return
                data = json.dumps(payload).encode() if payload is not None else b""
                extra = "Retry-After: 0\r\n" if status == 429 else ""
                writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n{extra}\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if self.down:
            return 503, {"error": "server is down (injected)"}
        if path == "/health":
            return 200, None
        if path in ("/get_model_info", "/get_weight_version"):
            return 200, {"model_path": "fault-server", "weight_version": str(self.weight_version)}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "fault-server", "object": "model"}]}
        request = json.loads(body or b"{}")
        if path == "/update_weights_from_disk":
            self.weight_version = int(request.get("weight_version", self.weight_version + 1))
            return 200, {"success": True, "message": "ok"}
        if path not in SAMPLING_PATHS:
            return 404, {"detail": f"no route {path}"}
        fault = self.faults.popleft() if self.faults else None
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        abort = False
        if fault is not None:
            if fault.startswith("slow:"):
                await asyncio.sleep(float(fault.split(":", 1)[1]))
            elif fault == "reset":
                return -1, None
            elif fault == "abort":
                abort = True
            else:
                return int(fault), {"error": f"injected HTTP {fault}"}
        return 200, self._answer(path, request, abort)

    def _answer(self, path: str, request: dict[str, Any], abort: bool) -> Any:
        if path == "/generate":
            n = request.get("sampling_params", {}).get("n", 1)
        else:
            n = request.get("n", 1)
        n = min(n, self.max_n) if self.max_n else n
        ids = list(range(10, 10 + self.output_len))
        lps = [-0.5] * self.output_len
        version = str(self.weight_version)
        finish = "abort" if abort else "length"
        if path == "/generate":
            items = [{"text": "x" * self.output_len, "output_ids": ids,
                      "meta_info": {"finish_reason": {"type": finish}, "weight_version": version,
                                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
                     for _ in range(n)]
            return items if request.get("sampling_params", {}).get("n", 1) > 1 else items[0]
        if path == "/v1/chat/completions":
            choices = [{"index": i, "message": {"role": "assistant", "content": "x" * self.output_len},
                        "finish_reason": finish, "logprobs": {"content": [{"token": "x", "logprob": lp} for lp in lps]}}
                       for i in range(n)]
        else:
            choices = [{"index": i, "text": "x" * self.output_len, "finish_reason": finish,
                        "logprobs": {"token_logprobs": lps}} for i in range(n)]
        return {"id": "fault", "object": "x", "model": request.get("model"), "choices": choices,
                "weight_version": version}


def main() -> None:
    parser = argparse.ArgumentParser(description="Instant SGLang/OpenAI-shaped server (no faults unless injected).")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    async def serve() -> None:
        server = FaultServer(args.port)
        await server.open()
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
