"""Bodies of 1 MiB and more are read into reused buffers (factory/serve/http.py BodyBuffers): every post is
stored as posted, whatever body the buffer held before (bigger, gzipped, or a different list)."""

from __future__ import annotations

import gzip
import http.client

import orjson

from bench.serve.run import make_groups
from factory.serve.http import POOLED_BODY_BYTES
from tests.unit.serve.test_ingest_faults import Api


def test_big_posts_through_reused_buffers_are_stored_as_posted(tmp_path):
    lists = [make_groups(9, start=0), make_groups(6, start=100), make_groups(7, start=200)]
    bodies = [orjson.dumps(groups) for groups in lists]
    assert all(len(body) >= POOLED_BODY_BYTES for body in bodies)
    with Api(tmp_path) as api:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
        for index, body in enumerate(bodies):  # the biggest first: the next ones land in its buffer
            headers = {"Content-Type": "application/json"}
            if index == 2:
                body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
            conn.request("POST", "/scored_data_list", body, headers)
            response = conn.getresponse()
            assert response.status == 200, response.read()
            assert orjson.loads(response.read())["groups_processed"] == len(lists[index])
        stored = {}
        for batch in api.service.store.iter_batches(api.config.ingest_run, columns=["tokens", "inference_logprobs"]):
            for tokens, logprobs in zip(batch.column("tokens").to_pylist(), batch.column("inference_logprobs").to_pylist()):
                stored[tokens[0][0]] = (tokens, logprobs)
        conn.close()
    posted = {group["tokens"][0][0]: (group["tokens"], group["inference_logprobs"]) for groups in lists for group in groups}
    assert stored == posted
