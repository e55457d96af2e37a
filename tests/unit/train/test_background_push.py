"""The background pusher: one push in flight, the trainer waits only for the previous one, errors reach the trainer."""

from __future__ import annotations

import threading
import time

import pytest

from factory.train import push as push_module
from factory.train.push import BackgroundPusher, WeightPushError


def test_a_push_runs_while_the_caller_goes_on_and_the_next_waits_for_it(monkeypatch) -> None:
    release = threading.Event()
    pushed: list[int] = []

    def slow_push(endpoints, checkpoint, version, *, timeout_s):
        release.wait(5)
        pushed.append(version)
        return 0.01

    monkeypatch.setattr(push_module, "push_weights", slow_push)
    pusher = BackgroundPusher(["http://x"])
    began = time.perf_counter()
    assert pusher.submit("/ckpt/2", 2) < 0.5  # nothing in flight: no wait
    assert time.perf_counter() - began < 0.5 and pushed == []  # the caller is not blocked by the push
    threading.Timer(0.2, release.set).start()
    waited = pusher.submit("/ckpt/4", 4)  # waits for version 2 first, keeping versions in order
    assert waited >= 0.1 and pushed[0] == 2
    pusher.wait()
    assert pushed == [2, 4] and pusher.pushes == 2


def test_a_failed_background_push_is_raised_to_the_trainer(monkeypatch) -> None:
    def refuse(endpoints, checkpoint, version, *, timeout_s):
        raise WeightPushError("http://x: pushing /ckpt refused: HTTP 500")

    monkeypatch.setattr(push_module, "push_weights", refuse)
    pusher = BackgroundPusher(["http://x"])
    pusher.submit("/ckpt/2", 2)
    with pytest.raises(WeightPushError, match="refused"):
        pusher.wait()
    assert pusher.wait() == pytest.approx(0.0, abs=0.1)  # the error is raised once


def test_the_batch_source_asks_again_when_the_api_drops_a_connection() -> None:
    import httpx

    from factory.train.sources import ApiBatchSource

    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json={"batch": [{"tokens": [[1]]}]})

    source = ApiBatchSource("http://api", batch_size=1, max_token_len=8, num_steps=1, poll_s=0.01, max_wait_s=5)
    source.http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler))
    assert source.next_batch() == [{"tokens": [[1]]}] and calls["n"] == 2
    source.close()
