"""A real run-api process gives back what a drain used: issue 29's memory bounds, checked on its RSS.

The server is "idle" here once it has served one batch of full-size groups: the first post loads pyarrow, numpy
and the Parquet code (~55 MiB of libraries and their module state, bench/RESULTS.md issue 29), which stay loaded
for the life of the process. What a drain must give back is everything above that: the queue's index, cached row
groups, prefetched bodies, Arrow buffers and freed heap. Bytes, not seconds: the bounds hold on a busy machine.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration

GROUP_SIZE, SEQ_LEN, BATCH = 8, 1024, 256
SINGLES, LISTS = 192, 2
"""192 groups posted one per request, then 2 posts of 64 (Atropos's /scored_data_list): ten batches of 8 x 1024-token
groups, ~190 MB of JSON, several times what a leak of one batch's buffers would keep; the test runs in ~10-15 s."""
GROUPS = SINGLES + 64 * LISTS


def status_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            fields[key] = int(rest.split()[0]) / 1024
    return fields


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now


def groups(count: int, start: int) -> list[dict]:
    """`count` distinct groups (wire dicts)."""
    base = [g.wire_dict() for g in synthetic_groups(16, group_size=GROUP_SIZE, seq_len=SEQ_LEN)]
    out = []
    for i in range(start, start + count):
        group = dict(base[i % len(base)])
        group["tokens"] = [[i, *group["tokens"][0][1:]], *group["tokens"][1:]]
        out.append(group)
    return out


def post_all(url: str, payloads: list[bytes], path: str = "/scored_data") -> None:
    def post(chunk: list[bytes]) -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"}) as http:
            for body in chunk:
                reply = http.post(path, content=body)
                assert reply.status_code == 200, reply.text[:300]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post, [payloads[i::4] for i in range(4)]))


def drain(url: str) -> int:
    groups = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        while batch := orjson.loads(http.get("/batch").content)["batch"]:
            groups += len(batch)
    return groups


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_rss_after_a_drain_is_back_near_idle_and_the_drain_stays_under_the_ingest_peak(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(tmp_path / "store"), "--log_level", "warning",
               "--recycle_idle_s", "0"]  # what one image gives back; a recycle (test_serve_recycle.py) returns the rest
    with ApiProcess(command, port, log_path=str(tmp_path / "api.log")) as api:
        pid = api.process.pid
        trainer = TrainerClient(api.url)
        trainer.register(BATCH, max_token_len=2 * SEQ_LEN)
        trainer.batch()
        EnvClient(api.url).register("memory", GROUP_SIZE, max_token_length=SEQ_LEN)
        made = groups(GROUPS + BATCH // GROUP_SIZE, 0)
        singles = [orjson.dumps(group) for group in made[:SINGLES]]
        lists = [orjson.dumps(made[start : start + 64]) for start in range(SINGLES, GROUPS, 64)]
        first = [orjson.dumps(group) for group in made[GROUPS:]]
        del made
        # one batch through ingest and /batch: what the first post loads is loaded, then the server is idle
        post_all(api.url, first)
        assert drain(api.url) == BATCH // GROUP_SIZE
        time.sleep(0.5)
        idle = status_mib(pid)

        reset_peak(pid)
        post_all(api.url, singles)
        post_all(api.url, lists, "/scored_data_list")  # last: its commit's rows were what the committer kept
        ingest_peak = status_mib(pid)["VmHWM"]
        reset_peak(pid)
        assert drain(api.url) == GROUPS
        drain_peak = status_mib(pid)["VmHWM"]
        after = status_mib(pid)
        deadline = time.monotonic() + 5  # the "no batch" answer gives it back already; a busy machine gets 5 s
        while not settled(idle, after) and time.monotonic() < deadline:
            time.sleep(0.2)
            after = status_mib(pid)

    detail = f"idle {idle}, ingest peak {ingest_peak:.1f}, drain peak {drain_peak:.1f}, after the drain {after}"
    assert ingest_peak > idle["VmRSS"] + 5, detail  # the load did use memory (else the bounds below prove nothing)
    # Here the 64-group posts set the ingest's peak (184-195 MiB, the drain's 128-132). With one group per request
    # only, both peaks are one batch being formed (the prefetch, during ingest) and came out within -1.7 .. +2.6 MiB
    # of each other: hence 1.05x, not 1x. A drain that piled batches up (issue 29: 199 -> 475 MiB) is far above.
    assert drain_peak <= 1.05 * ingest_peak, detail
    assert settled(idle, after), detail


def settled(idle: dict[str, float], after: dict[str, float]) -> bool:
    """Issue 29's bound, RSS within 20% of idle, and the heap itself (RssAnon) within 5 MiB of idle: 0.1-2.1 MiB in
    our runs; the group committer keeping its last commit's rows (64 groups here) came out 8.5-9.1 MiB above,
    Arrow's mimalloc pool as the C++ default (freed pages kept) 11.5."""
    return after["VmRSS"] <= 1.2 * idle["VmRSS"] and after["RssAnon"] <= idle["RssAnon"] + 5
