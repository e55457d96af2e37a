"""ASGI plumbing of the batching API: bearer auth, body size limit, gzip request bodies, fast JSON responses,
and the hot POST paths served beside (not through) FastAPI."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import hmac
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


try:  # Intel ISA-L: inflate about 2x zlib's speed on the gzip bodies Atropos env clients post; deflate 3-4x
    from isal import igzip as _igzip
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _igzip = None
    _zlib = zlib  # type: ignore[assignment]

THREAD_GUNZIP_BYTES = 64 << 10
POOLED_BODY_BYTES = 1 << 20
POOLED_BODY_MAX_BYTES = 64 << 20
"""Bodies from POOLED_BODY_BYTES to POOLED_BODY_MAX_BYTES (by their Content-Length) are read into reused buffers
(`BodyBuffers`); a buffer is allocated whole before the body arrives, so a bigger declared length is not trusted
with one (those bodies are joined as they arrive, as are bodies without a Content-Length)."""
POOLED_LENT_MAX_BYTES = 256 << 20
"""At most this many bytes of buffers are lent to bodies still arriving: clients that declare big bodies and then
stall hold no more than this between them; further bodies are joined as they arrive."""


class BodyError(Exception):
    """A request body refused before it is parsed: `status` is 400 (bad gzip) or 413 (too big)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> Response:
    return Response(orjson.dumps({"detail": message}), status_code=status, media_type="application/json")


def inflate_gzip(body: bytes, limit: int) -> bytes:
    """The gunzipped body, at most `limit` bytes (BodyError otherwise). Lets go of the GIL while inflating."""
    decompressor = _zlib.decompressobj(16 + _zlib.MAX_WBITS)
    try:
        inflated = decompressor.decompress(body, limit + 1)
    except _zlib.error as error:
        raise BodyError(400, f"Content-Encoding is gzip but the body is not valid gzip: {error}") from None
    if len(inflated) > limit or decompressor.unconsumed_tail:
        raise BodyError(413, f"decompressed body is over the limit of {limit} bytes (config max_body_mb)")
    return inflated


def gzip_compress(body: bytes, level: int) -> bytes:
    """`body` gzipped at zlib's `level` (1-9), through ISA-L where it is installed: its levels 1, 2 and 3 stand for
    zlib's 1-3, 4-6 and 7-9. On a 7 MB /batch body ISA-L's level 1 took 17 ms for 3.0 MB, zlib's 48 ms for 3.1 MB."""
    if _igzip is not None:
        return _igzip.compress(body, (level + 2) // 3, mtime=0)
    return gzip.compress(body, compresslevel=level, mtime=0)


def gzip_compressor(level: int) -> Any:
    """A streaming compressor writing what `gzip_compress` writes (gzip framing, mtime 0) at zlib's `level`."""
    if _igzip is not None:
        return _zlib.compressobj((level + 2) // 3, _zlib.DEFLATED, 31)
    return zlib.compressobj(level, zlib.DEFLATED, 31)


def gzip_size_hint(body: bytes, limit: int) -> int:
    """The decompressed size a gzip body declares in its trailer (ISIZE), capped at `limit`."""
    return min(limit, int.from_bytes(body[-4:], "little")) if len(body) >= 18 else len(body)


def _headers(scope: Scope) -> dict[str, str]:
    return {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}


class _Guard:
    """Bearer token and body size checks shared by both request paths."""

    def __init__(self, token: str | None, max_body_bytes: int) -> None:
        self.token = token
        self.max_body = max_body_bytes

    def refusal(self, headers: dict[str, str]) -> Response | None:
        if self.token is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                response = _error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the service's api_token)")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return _error(413, f"body of {declared} bytes is over the limit of {self.max_body} (config max_body_mb)")
        return None

    async def read_body(self, receive: Receive, into: bytearray | None = None) -> bytes | memoryview | Response | None:
        """The whole body, a 413 response, or None if the client went away. With `into` (as long as the declared
        Content-Length): the body is copied there as it arrives and a view of it returned, unless it turns out
        longer than declared (then it is joined as below)."""
        if into is not None:
            view, at = memoryview(into), 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                if at + len(chunk) > len(view):
                    return await self._joined(receive, [view[:at], chunk], at + len(chunk), more)
                view[at : at + len(chunk)] = chunk
                at += len(chunk)
                if not more:
                    return view[:at]
        return await self._joined(receive, [], 0, True)

    async def _joined(self, receive: Receive, chunks: list[Any], size: int, more: bool) -> bytes | Response | None:
        if size > self.max_body:
            return _error(413, f"body is over the limit of {self.max_body} bytes (config max_body_mb)")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return _error(413, f"body is over the limit of {self.max_body} bytes (config max_body_mb)")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


class BodyBuffers:
    """Reused buffers for big request bodies (POOLED_BODY_BYTES to POOLED_BODY_MAX_BYTES, Content-Length declared).

    A body joined into a new bytes object costs a fresh allocation of its size: above glibc's mmap threshold
    (1 MiB here, factory/serve/memory.py) every one is a new mapping whose pages fault in while the body is
    copied, then unmapped. A 14 MB body of 64 groups: 6-11 ms to join, 1.4 ms to copy into a buffer already
    mapped. The buffers a burst used stay here for reuse until no body was taken for `idle_s`; then they are
    dropped (RSS back to what the service holds) and `on_idle` is called (the decoder's kept buffers go too)."""

    def __init__(self, *, idle_s: float = 0.25, keep: int = 16, on_idle: Callable[[], None] | None = None) -> None:
        self.idle_s, self.keep, self.on_idle = idle_s, keep, on_idle
        self._free: list[bytearray] = []
        self.lent = 0
        """Bytes of the buffers taken and not given back yet (bodies arriving or being handled)."""
        self._last_take = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def take(self, size: int) -> bytearray | None:
        """A buffer of at least `size` bytes, reused if one is free; None when POOLED_LENT_MAX_BYTES are lent."""
        loop = asyncio.get_running_loop()
        self._last_take = loop.time()
        fits = [i for i, buffer in enumerate(self._free) if len(buffer) >= size]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        elif self.lent + size > POOLED_LENT_MAX_BYTES:
            return None
        else:
            buffer = bytearray(-(-size // POOLED_BODY_BYTES) * POOLED_BODY_BYTES)  # whole MiBs: bodies vary a little
        self.lent += len(buffer)
        return buffer

    def give(self, buffer: bytearray, *, reuse: bool = True) -> None:
        """`buffer` is no longer lent; `reuse`: nothing holds a view of it any more, so it may be taken again."""
        self.lent -= len(buffer)
        if not reuse:
            return
        self._free.append(buffer)
        if len(self._free) > self.keep:
            self._free.remove(min(self._free, key=len))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._drop_if_idle)

    def _drop_if_idle(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last_take
        if idle >= self.idle_s:
            self._free.clear()
            if self.on_idle is not None:
                self.on_idle()
        else:
            self._timer = loop.call_later(self.idle_s - idle, self._drop_if_idle)


class RequestGuard:
    """Checks the bearer token, bounds the body (compressed and decompressed) and un-gzips it."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.guard = _Guard(token, max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self.guard.refusal(headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        body = await self.guard.read_body(receive)
        if body is None:
            return
        if isinstance(body, Response):
            await body(scope, receive, send)
            return
        encoding = headers.get("content-encoding", "").lower()
        if "gzip" in encoding:
            try:
                if len(body) >= THREAD_GUNZIP_BYTES:  # big bodies inflate beside the event loop
                    body = await asyncio.to_thread(inflate_gzip, body, self.guard.max_body)
                elif body:
                    body = inflate_gzip(body, self.guard.max_body)
            except BodyError as error:
                await _error(error.status, str(error))(scope, receive, send)
                return
            scope = dict(scope)
            scope["headers"] = [
                (key, str(len(body)).encode() if key.lower() == b"content-length" else value)
                for key, value in scope["headers"]
                if key.lower() != b"content-encoding"
            ]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


PostHandler = Callable[["bytes | memoryview", bool, "str | None"], Awaitable[Response]]
"""(body as received, whether it is gzipped, Idempotency-Key) -> the response. The body may be a view of a
reused buffer: the handler must not keep it (or anything viewing it) after it returns."""


class FastPosts:
    """POSTs to a few hot paths (every env posts every group there) answered without the FastAPI stack.

    Same checks and answers as the full stack (token, body limits, gzip, the handler's JSON); requests
    with an Origin header still go through the full stack, whose CORS middleware answers browsers.
    The body stays compressed here: the handler inflates it in its worker thread, with the decoding.
    """

    def __init__(self, app: ASGIApp, handlers: dict[str, PostHandler], *, token: str | None, max_body_bytes: int,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.app = app
        self.handlers = handlers
        self.guard = _Guard(token, max_body_bytes)
        self.buffers = BodyBuffers(on_idle=on_idle)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if "origin" in headers:
            await self.app(scope, receive, send)
            return
        response = self.guard.refusal(headers)
        if response is None:
            declared = headers.get("content-length", "")
            pooled = declared.isdigit() and POOLED_BODY_BYTES <= int(declared) <= POOLED_BODY_MAX_BYTES
            buffer = self.buffers.take(int(declared)) if pooled else None
            reusable = False
            try:
                body = await self.guard.read_body(receive, buffer)
                if body is None:
                    return
                if isinstance(body, Response):
                    response = body
                else:
                    gzipped = "gzip" in headers.get("content-encoding", "").lower() and bool(body)
                    response = await handler(body, gzipped, headers.get("idempotency-key") or None)
                del body
                reusable = True  # the handler returned: a cancelled or failed one may still be reading the buffer
            finally:
                if buffer is not None:
                    self.buffers.give(buffer, reuse=reusable)
        await response(scope, receive, send)


def accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def from_loopback(request: Request) -> bool:
    """Whether the request came over the loopback interface (127.0.0.0/8, ::1): a client on this host."""
    host = request.client.host if request.client is not None else None
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:  # not an address (a Unix socket's peer, a test client's name)
        return False


def gzip_wanted(request: Request, loopback: bool) -> bool:
    """Whether to gzip a response to `request`: the client takes gzip and, unless `loopback` (ServeConfig.gzip_loopback),
    is not on this host. Over loopback gzip saves no transfer time, only costs CPU at both ends: the client's inflate
    of a 7 MB /batch body (32 groups of 8 x 1024 tokens) took 35-55 ms with zlib, most of the request's time."""
    return accepts_gzip(request) and (loopback or not from_loopback(request))


def json_response(
    request: Request,
    data: Any = None,
    *,
    raw: bytes | memoryview | None = None,
    gz: bytes | memoryview | None = None,
    status: int = 200,
    gzip_level: int = 1,
    gzip_min_bytes: int = 1000,
    gzip_loopback: bool = True,
) -> Response:
    """JSON bytes (given, or orjson of `data`), gzipped when the client accepts it (and, unless `gzip_loopback`, is not
    on this host) and it is big enough."""
    body = raw if raw is not None else orjson.dumps(data)
    headers = {"vary": "Accept-Encoding"}
    if gzip_wanted(request, gzip_loopback) and gzip_level > 0 and len(body) >= gzip_min_bytes:
        body = gz if gz is not None else gzip_compress(body, gzip_level)
        headers["content-encoding"] = "gzip"
    return Response(body, status_code=status, media_type="application/json", headers=headers)
