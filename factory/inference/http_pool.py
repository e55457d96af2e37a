"""HTTP for the inference client: a lean keep-alive client for http:// endpoints, httpx pools for https://."""

from __future__ import annotations

import asyncio
import functools
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson


class ShardedHttp:
    """Several small httpx pools instead of one big one.

    Measured here: one httpx.AsyncClient with 32 requests in flight managed
    ~65 calls/s against an instant server, 8 clients of 4 connections ~350.
    Each request takes the shard with the fewest in flight.
    """

    PER_SHARD = 8

    def __init__(self, connections: int, **kwargs: Any) -> None:
        count = max(1, -(-connections // self.PER_SHARD))
        limits = httpx.Limits(max_connections=self.PER_SHARD + 2, max_keepalive_connections=self.PER_SHARD + 2)
        self.shards = [httpx.AsyncClient(limits=limits, **kwargs) for _ in range(count)]
        self.load = [0] * count

    async def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        index = min(range(len(self.shards)), key=self.load.__getitem__)
        self.load[index] += 1
        try:
            return await self.shards[index].request(method, url, **kwargs)
        finally:
            self.load[index] -= 1

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self._call("GET", url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self._call("POST", url, **kwargs)

    async def aclose(self) -> None:
        await asyncio.gather(*(shard.aclose() for shard in self.shards))


class Response:
    """What the inference client reads of an answer: status, lower-cased headers, body (httpx.Response's names)."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return orjson.loads(self.content)  # orjson.JSONDecodeError is a ValueError, as json's is


class _Stale(Exception):
    """A kept-alive connection the server had closed: nothing of an answer was read, so the request is resent."""


class KeepAliveHttp:
    """HTTP/1.1 with keep-alive on asyncio streams, for plain http:// endpoints; https:// goes to `ShardedHttp`.

    The request path is most of a datagen worker's CPU (bench/RESULTS.md, issue 33): httpx spends ~2 ms of CPU
    per call in its pool, anyio and h11 layers. This writes the request in one buffer and reads the answer with
    two or three stream reads. Failures raise httpx's exception classes (ConnectError, ConnectTimeout,
    ReadTimeout, RemoteProtocolError), so callers keep their handling and messages. The EndpointPool caps
    requests in flight per endpoint, which caps connections too; idle ones are kept up to `max_idle` per host.
    """

    def __init__(self, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None, max_idle: int = 256,
                 connections: int = 64) -> None:
        self.timeout = timeout
        self.extra_headers = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._fallback: ShardedHttp | None = None
        self._fallback_args = {"connections": connections, "timeout": timeout, "headers": headers}
        self._read_deadlines = ReadDeadlines()

    async def get(self, url: str, *, timeout: float | None = None) -> Any:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, *, json: Any = None, timeout: float | None = None) -> Any:
        return await self.request("POST", url, json=json, timeout=timeout)

    async def request(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> Any:
        scheme, host, port, target = _split(url)
        if scheme != "http":
            return await self._https(method, url, json=json, timeout=timeout)
        body = b"" if json is None and method == "GET" else orjson.dumps(json)
        head = (f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n{self.extra_headers}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
        read_s = self.timeout.read if timeout is None else timeout
        connect_s = self.timeout.connect if timeout is None else min(timeout, self.timeout.connect or timeout)
        idle = self._idle.setdefault((host, port), [])
        while idle:  # a kept-alive connection, resent once on a fresh one if the server had closed it
            connection = idle.pop()
            try:
                return await self._exchange(connection, (host, port), head + body, read_s, reused=True)
            except _Stale:
                continue
        connection = await self._connect(host, port, connect_s)
        return await self._exchange(connection, (host, port), head + body, read_s, reused=False)

    async def _connect(self, host: str, port: int, timeout: float | None) -> Any:
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.open_connection(host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {timeout} s") from None
        except OSError as error:
            raise httpx.ConnectError(f"{error.strerror or error} ({host}:{port})") from None

    async def _exchange(self, connection: Any, key: tuple[str, int], data: bytes, timeout: float | None,
                        *, reused: bool) -> Response:
        reader, writer = connection
        keep = False
        started = False
        deadlines = self._read_deadlines
        task = deadlines.watch(timeout)
        try:
            writer.write(data)
            if writer.transport.get_write_buffer_size():  # else all of it went to the socket: nothing to wait for
                await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as error:
                if reused and not error.partial:
                    raise _Stale from None
                raise
            started = True
            response, keep = await _read_answer(reader, head)
        except _Stale:
            writer.close()
            raise
        except asyncio.CancelledError:
            writer.close()  # cancelled mid-exchange: the connection's state is unknown
            if deadlines.expired(task):
                raise httpx.ReadTimeout(f"no answer within {timeout} s") from None
            raise
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
            writer.close()
            if reused and not started and isinstance(error, ConnectionError):
                raise _Stale from None
            raise httpx.RemoteProtocolError(f"connection lost mid-answer ({type(error).__name__}: {error})") from None
        except ValueError as error:
            writer.close()
            raise httpx.RemoteProtocolError(f"malformed HTTP answer: {error}") from None
        except BaseException:
            writer.close()
            raise
        finally:
            deadlines.forget(task)
        if keep and len(self._idle[key]) < self.max_idle:
            self._idle[key].append(connection)
        else:
            writer.close()
        return response

    async def _https(self, method: str, url: str, *, json: Any, timeout: float | None) -> Any:
        if self._fallback is None:
            args = self._fallback_args
            self._fallback = ShardedHttp(args["connections"], timeout=args["timeout"], headers=args["headers"])
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if json is not None:
            kwargs["json"] = json
        return await self._fallback._call(method, url, **kwargs)

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


class ReadDeadlines:
    """The read timeouts of one event loop's exchanges in flight, enforced by one coarse timer for all of them.

    `asyncio.timeout` schedules and cancels a timer handle per request, ~5.7 us of a datagen worker's ~200 us of
    CPU per group (issue 33). Here a request costs a dict entry, and one timer every `TICK_S` (only while requests
    are in flight) cancels the tasks past their deadline, so a read timeout fires up to `TICK_S` late."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self._deadlines: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._ticking: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, timeout: float | None) -> asyncio.Task | None:
        """Start the current task's read clock (None: no timeout); pass what it returns to `forget`."""
        if timeout is None:
            return None
        task = asyncio.current_task()
        loop = task.get_loop()
        if loop is not self._loop:  # a new event loop (a client reused after asyncio.run ended): a new timer
            self._loop, self._ticking = loop, None
        self._deadlines[task] = loop.time() + timeout
        if self._ticking is None:
            self._ticking = loop.call_later(self.TICK_S, self._tick, loop)
        return task

    def forget(self, task: asyncio.Task | None) -> None:
        if task is not None:
            self._deadlines.pop(task, None)
            self._expired.discard(task)

    def expired(self, task: asyncio.Task | None) -> bool:
        """Whether this task's cancellation was its read timeout alone (then taken back from the task)."""
        if task is None or task not in self._expired:
            return False
        self._expired.discard(task)
        return task.uncancel() == 0  # cancelled by someone else too: that cancellation goes on

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._ticking = loop.call_later(self.TICK_S, self._tick, loop) if self._deadlines else None


@functools.lru_cache(maxsize=256)
def _split(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), target


async def _read_answer(reader: asyncio.StreamReader, head: bytes) -> tuple[Response, bool]:
    """The answer after its header block; and whether the connection may be kept alive."""
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split(" ", 2)[:2]
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        content = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        content = b"".join(parts)
    else:
        content, keep = await reader.read(), False
    return Response(int(status), headers, content), keep
