"""gzip of responses (factory/serve/http.py): any gzip reader inflates it, and higher levels compress harder."""

import gzip

import orjson

from factory.serve.http import gzip_compress


def test_every_level_is_standard_gzip_and_higher_levels_are_not_larger():
    body = orjson.dumps({"batch": [{"tokens": [[i % 977 for i in range(k, k + 4096)]], "scores": [k / 7]} for k in range(64)]})
    sizes = []
    for level in range(1, 10):
        compressed = gzip_compress(body, level)
        assert compressed[:2] == b"\x1f\x8b" and gzip.decompress(compressed) == body
        sizes.append(len(compressed))
    assert sizes[-1] <= sizes[0] < len(body) // 4
    assert gzip_compress(body, 1) == gzip_compress(body, 1)  # no timestamp: the same body compresses the same


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
