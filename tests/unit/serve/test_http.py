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
