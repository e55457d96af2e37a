"""KeepAliveHttp: the inference client's HTTP/1.1 on asyncio streams, against a hand-written server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from factory.inference.http_pool import KeepAliveHttp

TIMEOUT = httpx.Timeout(2.0, connect=1.0)


async def serve(answer, *, close_after: int | None = None):
    """A server that reads one request at a time and writes `answer(request_bytes)`; returns (server, port, seen)."""
    seen = {"connections": 0, "requests": []}

    async def handle(reader, writer):
        seen["connections"] += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")][0])
                body = await reader.readexactly(length)
                seen["requests"].append(head + body)
                data = answer(head + body)
                if data is None:
                    await asyncio.sleep(10)
                writer.write(data)
                await writer.drain()
                served += 1
                if close_after is not None and served >= close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def test_keeps_one_connection_alive_and_sends_json_and_headers():
    async def main():
        server, port, seen = await serve(lambda _request: ok())
        http = KeepAliveHttp(timeout=TIMEOUT, headers={"Authorization": "Bearer k"})
        for _ in range(3):
            response = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"n": 2})
            assert response.status_code == 200 and response.json() == {"ok": True}
        await http.aclose()
        server.close()
        return seen

    seen = asyncio.run(main())
    assert seen["connections"] == 1 and len(seen["requests"]) == 3
    first = seen["requests"][0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in first and first.endswith(b'{"n":2}')


def test_a_body_larger_than_the_socket_buffer_is_sent_whole_before_the_answer_is_read():
    prompt = list(range(2_000_000))  # ~15 MB of JSON: the kernel takes a part, the rest waits in the transport

    async def main():
        server, port, seen = await serve(lambda request: ok(b'{"bytes": %d}' % len(request.split(b"\r\n\r\n", 1)[1])))
        http = KeepAliveHttp(timeout=TIMEOUT)
        for _ in range(2):
            response = await http.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": prompt})
            assert response.json() == {"bytes": len(seen["requests"][-1].split(b"\r\n\r\n", 1)[1])}
        await http.aclose()
        server.close()
        return seen

    seen = asyncio.run(main())
    assert seen["connections"] == 1 and all(request.endswith(b"1999999]}") for request in seen["requests"])


def test_a_connection_the_server_closed_is_replaced_without_an_error():
    async def main():
        server, port, seen = await serve(lambda _request: ok(), close_after=1)
        http = KeepAliveHttp(timeout=TIMEOUT)
        for _ in range(3):
            assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            await asyncio.sleep(0.05)  # the server's close reaches the client's idle connection
        await http.aclose()
        server.close()
        return seen

    assert asyncio.run(main())["connections"] == 3


def test_chunked_answers_connection_close_and_status_text():
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\nRetry-After: 2\r\n\r\n"
               b"5\r\nbusy \r\n3;x=y\r\nnow\r\n0\r\n\r\n")

    async def main():
        server, port, seen = await serve(lambda _request: chunked)
        http = KeepAliveHttp(timeout=TIMEOUT)
        response = await http.post(f"http://127.0.0.1:{port}/generate", json={})
        assert response.status_code == 503 and response.text == "busy now" and response.headers["retry-after"] == "2"
        await http.aclose()
        server.close()
        server2, port2, seen2 = await serve(lambda _request: ok(extra=b"Connection: close\r\n"))
        http = KeepAliveHttp(timeout=TIMEOUT)
        for _ in range(2):
            assert (await http.get(f"http://127.0.0.1:{port2}/")).json() == {"ok": True}
        await http.aclose()
        server2.close()
        return seen2

    assert asyncio.run(main())["connections"] == 2  # Connection: close is honoured


def test_failures_raise_httpx_exceptions_the_client_already_handles():
    async def main():
        server, port, _ = await serve(lambda _request: None)  # never answers
        http = KeepAliveHttp(timeout=httpx.Timeout(0.2, connect=0.2))
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"http://127.0.0.1:{port}/generate", json={})
        server.close()
        await server.wait_closed()
        with pytest.raises(httpx.ConnectError):
            await http.post(f"http://127.0.0.1:{port}/generate", json={})
        server3, port3, _ = await serve(lambda _request: b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort",
                                        close_after=1)
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(f"http://127.0.0.1:{port3}/generate", json={})
        server3.close()
        await http.aclose()

    asyncio.run(main())


def test_a_read_timeout_fires_on_time_in_each_event_loop_and_other_cancellations_stay_cancellations():
    http = KeepAliveHttp(timeout=httpx.Timeout(0.3, connect=1.0))

    async def timed_out():
        server, port, _ = await serve(lambda _request: None)  # never answers
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(httpx.ReadTimeout, match="no answer within 0.3 s"):
            await http.post(f"http://127.0.0.1:{port}/generate", json={})
        waited = loop.time() - started
        assert 0.3 <= waited < 0.3 + 4 * http._read_deadlines.TICK_S
        assert asyncio.current_task().cancelling() == 0  # the timeout's cancellation was taken back
        # a caller's own cancellation is not turned into a timeout
        request = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/generate", json={}))
        await asyncio.sleep(0.05)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        server.close()

    asyncio.run(timed_out())
    asyncio.run(timed_out())  # the same client in a second event loop: its timer is that loop's
    asyncio.run(http.aclose())
