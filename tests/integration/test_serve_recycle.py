"""A real run-api process recycles itself once a burst of work is over (factory/serve/recycle.py): same pid, RSS
back to a fresh start's, pyarrow no longer mapped, and nothing lost, served twice or forgotten across the exec."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")]

GROUP_SIZE, SEQ_LEN, BATCH = 8, 64, 256
GROUPS_PER_BATCH = BATCH // GROUP_SIZE


def groups(count: int, start: int) -> list[bytes]:
    """`count` distinct one-group bodies; group i's first token is i."""
    base = [g.wire_dict() for g in synthetic_groups(4, group_size=GROUP_SIZE, seq_len=SEQ_LEN)]
    bodies = []
    for i in range(start, start + count):
        group = dict(base[i % len(base)])
        group["tokens"] = [[i, *group["tokens"][0][1:]], *group["tokens"][1:]]
        bodies.append(orjson.dumps(group))
    return bodies


def post(url: str, bodies: list[bytes]) -> None:
    with httpx.Client(base_url=url, timeout=60, headers={"Content-Type": "application/json"}) as http:
        for body in bodies:
            reply = http.post("/scored_data", content=body)
            assert reply.status_code == 200, reply.text[:300]


def drain(url: str) -> list[int]:
    """First tokens of every group served until "no batch"."""
    served = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while batch := orjson.loads(http.get("/batch").content)["batch"]:
            served += [group["tokens"][0][0] for group in batch]
    return served


def arrow_mapped(pid: int) -> bool:
    return "libarrow" in Path(f"/proc/{pid}/maps").read_text()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def command(port: int, store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
            "--store_root", str(store), "--log_level", "info", *extra]


def registered(api: ApiProcess, env: bool = True) -> TrainerClient:
    """A trainer (batches of BATCH sequences) that has started, and (`env`) an env registered."""
    trainer = TrainerClient(api.url)
    trainer.register(BATCH, max_token_len=2 * SEQ_LEN)
    trainer.batch()
    if env:
        EnvClient(api.url).register("recycle", GROUP_SIZE, max_token_length=SEQ_LEN)
    return trainer


def test_a_drained_server_starts_again_in_place_and_loses_nothing(tmp_path):
    port = free_port()
    with ApiProcess(command(port, tmp_path / "store"), port, log_path=str(tmp_path / "api.log")) as api:
        pid = api.process.pid
        registered(api)
        time.sleep(0.5)
        idle_rss = rss_mib(pid)
        assert not arrow_mapped(pid)

        post(api.url, groups(GROUPS_PER_BATCH + 8, 0))  # a batch and 8 groups that make no batch
        first = drain(api.url)
        assert sorted(first) == list(range(GROUPS_PER_BATCH))
        assert arrow_mapped(pid)

        # quiet with 8 groups queued (less than a batch): it recycles, and the new image stays dormant
        assert wait_for(lambda: not arrow_mapped(pid), 15), "still holding pyarrow 15 s after the drain"
        assert api.process.poll() is None and api.process.pid == pid
        status = httpx.get(api.url + "/status", timeout=30).json()
        assert (status["current_step"], status["queue_size"], status["served_groups"]) == (1, 8, GROUPS_PER_BATCH)
        assert rss_mib(pid) <= 1.2 * idle_rss, (rss_mib(pid), idle_rss)
        assert not arrow_mapped(pid)  # /status and /batch ("no batch") answered without loading it
        assert orjson.loads(httpx.get(api.url + "/batch", timeout=30).content)["batch"] is None

        # the first post wakes it: the 8 queued groups and the new ones make the next batch, each once
        post(api.url, groups(GROUPS_PER_BATCH - 8, 100))
        second = drain(api.url)
        assert sorted(second) == list(range(GROUPS_PER_BATCH, GROUPS_PER_BATCH + 8)) + list(range(100, 124))
        assert httpx.get(api.url + "/status", timeout=30).json()["current_step"] == 2

        # at most one recycle per recycle_min_interval_s (60 s by default)
        time.sleep(2.5)
        assert arrow_mapped(pid)
    log = (tmp_path / "api.log").read_text()
    assert log.count("starting again in place") == 1, log[-3000:]
    assert "dormant until there is work" in log


def test_a_trainer_that_rewinds_after_a_recycle_gets_the_same_batch_again(tmp_path):
    port = free_port()
    with ApiProcess(command(port, tmp_path / "store"), port, log_path=str(tmp_path / "api.log")) as api:
        pid = api.process.pid
        trainer = registered(api)
        post(api.url, groups(GROUPS_PER_BATCH, 0))
        first = drain(api.url)
        assert wait_for(lambda: not arrow_mapped(pid), 15)
        trainer.register(BATCH, max_token_len=2 * SEQ_LEN, starting_step=0)  # a trainer restarted from step 0
        again = orjson.loads(httpx.get(api.url + "/batch", timeout=30).content)["batch"]
        assert [group["tokens"][0][0] for group in again] == first


def test_recycle_idle_s_0_keeps_one_image(tmp_path):
    port = free_port()
    with ApiProcess(command(port, tmp_path / "store", "--recycle_idle_s", "0"), port) as api:
        pid = api.process.pid
        registered(api, env=False)
        post(api.url, groups(GROUPS_PER_BATCH, 0))
        assert len(drain(api.url)) == GROUPS_PER_BATCH
        time.sleep(2.5)
        assert arrow_mapped(pid)
