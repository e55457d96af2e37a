"""ASGI plumbing of the batching API: bearer auth, body size limit, gzip request bodies, fast JSON responses."""

from __future__ import annotations

import asyncio
import gzip
import hmac
import zlib
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


THREAD_GUNZIP_BYTES = 64 << 10


def _error(status: int, message: str) -> Response:
    return Response(orjson.dumps({"detail": message}), status_code=status, media_type="application/json")


class RequestGuard:
    """Checks the bearer token, bounds the body (compressed and decompressed) and un-gzips it."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.token = token
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if self.token is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                response = _error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the service's api_token)")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _error(413, f"body of {declared} bytes is over the limit of {self.max_body} (config max_body_mb)")(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _error(413, f"body is over the limit of {self.max_body} bytes (config max_body_mb)")(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        encoding = headers.get("content-encoding", "").lower()
        if "gzip" in encoding and body:
            decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                if len(body) >= THREAD_GUNZIP_BYTES:  # zlib lets go of the GIL: big bodies inflate beside the event loop
                    body = await asyncio.to_thread(decompressor.decompress, body, self.max_body + 1)
                else:
                    body = decompressor.decompress(body, self.max_body + 1)
            except zlib.error as error:
                await _error(400, f"Content-Encoding is gzip but the body is not valid gzip: {error}")(scope, receive, send)
                return
            if len(body) > self.max_body or decompressor.unconsumed_tail:
                await _error(413, f"decompressed body is over the limit of {self.max_body} bytes (config max_body_mb)")(
                    scope, receive, send
                )
                return
        if "gzip" in encoding:
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


def accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def json_response(
    request: Request,
    data: Any = None,
    *,
    raw: bytes | None = None,
    gz: bytes | None = None,
    status: int = 200,
    gzip_level: int = 1,
    gzip_min_bytes: int = 1000,
) -> Response:
    """JSON bytes (given, or orjson of `data`), gzipped when the client accepts it and it is big enough."""
    body = raw if raw is not None else orjson.dumps(data)
    headers = {"vary": "Accept-Encoding"}
    if accepts_gzip(request) and gzip_level > 0 and len(body) >= gzip_min_bytes:
        body = gz if gz is not None else gzip.compress(body, compresslevel=gzip_level, mtime=0)
        headers["content-encoding"] = "gzip"
    return Response(body, status_code=status, media_type="application/json", headers=headers)
