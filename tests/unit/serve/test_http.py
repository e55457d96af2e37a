"""factory/serve/http.py: gzip of responses (any gzip reader inflates it, higher levels compress harder; none to clients
on this host unless asked) and bodies read into reused buffers."""

import asyncio
import gzip

import orjson

from factory.serve.http import BodyBuffers, _Guard, gzip_compress


def test_every_level_is_standard_gzip_and_higher_levels_are_not_larger():
    body = orjson.dumps({"batch": [{"tokens": [[i % 977 for i in range(k, k + 4096)]], "scores": [k / 7]} for k in range(64)]})
    sizes = []
    for level in range(1, 10):
        compressed = gzip_compress(body, level)
        assert compressed[:2] == b"\x1f\x8b" and gzip.decompress(compressed) == body
        sizes.append(len(compressed))
    assert sizes[-1] <= sizes[0] < len(body) // 4
    assert gzip_compress(body, 1) == gzip_compress(body, 1)  # no timestamp: the same body compresses the same


def _receive(chunks: list[bytes]):
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1} for i, chunk in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    return receive


def test_a_body_read_into_a_buffer_is_the_body_and_a_longer_one_than_declared_still_arrives_whole():
    guard = _Guard(None, 1 << 20)
    chunks = [bytes([i]) * 1000 for i in range(5)]

    async def read(into):
        return await guard.read_body(_receive(list(chunks)), into)

    assert asyncio.run(read(None)) == b"".join(chunks)
    buffer = bytearray(8000)
    body = asyncio.run(read(buffer))
    assert isinstance(body, memoryview) and body.obj is buffer and bytes(body) == b"".join(chunks)
    assert asyncio.run(read(bytearray(2500))) == b"".join(chunks)  # more than the buffer holds: joined
    assert asyncio.run(_Guard(None, 3000).read_body(_receive(list(chunks)), bytearray(2500))).status_code == 413


def test_body_buffers_are_reused_while_posts_come_and_dropped_once_they_stop():
    dropped = []

    async def scenario():
        buffers = BodyBuffers(idle_s=0.05, on_idle=lambda: dropped.append(True))
        first = buffers.take(3 << 20)
        assert len(first) >= 3 << 20
        buffers.give(first)
        assert buffers.take(2 << 20) is first  # a free one that fits
        second = buffers.take(2 << 20)
        assert second is not first
        buffers.give(first)
        buffers.give(second)
        await asyncio.sleep(0.02)
        assert buffers.take(5 << 20) not in (first, second) and len(buffers._free) == 2 and not dropped
        await asyncio.sleep(0.15)
        return buffers

    buffers = asyncio.run(scenario())
    assert buffers._free == [] and dropped == [True]


def test_body_buffers_lend_at_most_their_cap_and_failed_bodies_give_theirs_back_unreused():
    from factory.serve.http import POOLED_LENT_MAX_BYTES

    async def scenario():
        buffers = BodyBuffers(idle_s=10)
        size = 32 << 20
        lent = [buffers.take(size) for _ in range(POOLED_LENT_MAX_BYTES // size)]
        assert all(buffer is not None for buffer in lent)
        assert buffers.take(size) is None  # stalled clients hold no more than the cap: the next body is joined
        buffers.give(lent.pop(), reuse=False)  # a body that failed: its buffer is not lent any more, nor reused
        assert buffers._free == []
        again = buffers.take(size)
        assert again is not None and buffers.lent == POOLED_LENT_MAX_BYTES
        for buffer in [*lent, again]:
            buffers.give(buffer)
        assert buffers.lent == 0

    asyncio.run(scenario())

def _request(host: str | None, accept: str = "gzip, deflate"):
    from starlette.requests import Request

    return Request({"type": "http", "method": "GET", "path": "/batch", "headers": [(b"accept-encoding", accept.encode())],
                    "client": None if host is None else (host, 50000)})


def test_responses_to_clients_on_this_host_are_not_gzipped_unless_asked():
    from factory.serve.http import from_loopback, gzip_wanted, json_response

    assert from_loopback(_request("127.0.0.1")) and from_loopback(_request("::1")) and from_loopback(_request("127.8.0.3"))
    assert not any(from_loopback(_request(h)) for h in ("10.0.0.2", "2001:db8::1", "testclient", None))
    assert gzip_wanted(_request("10.0.0.2"), loopback=False) and not gzip_wanted(_request("127.0.0.1"), loopback=False)
    assert gzip_wanted(_request("127.0.0.1"), loopback=True)
    assert not gzip_wanted(_request("10.0.0.2", accept="identity"), loopback=True)
    body = orjson.dumps({"batch": [{"tokens": list(range(1000))}]})
    local = json_response(_request("127.0.0.1"), raw=body, gzip_loopback=False)
    remote = json_response(_request("10.0.0.2"), raw=body, gzip_loopback=False)
    assert "content-encoding" not in local.headers and local.body == body
    assert remote.headers["content-encoding"] == "gzip" and gzip.decompress(remote.body) == body
