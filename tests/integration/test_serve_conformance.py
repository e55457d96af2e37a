"""Conformance of `run-api` with Atropos's batching API, endpoint by endpoint, from its documented behaviour.

Each test is what an Atropos trainer or environment does and sees: every
endpoint, odd-but-valid bodies (messages omitted / null / empty, empty and
numeric message contents, per-token fields whose lengths don't match tokens,
sft and group overrides, repeated identical groups), gzip in both directions,
list posts, env registration and weights, /status-env and /reset_data.

The same tests run against atroposlib 0.4.0's own run-api with
`FACTORY_CONFORMANCE_ATROPOS=1` (needs the venv of bench/atropos_venv.py),
which is how they were checked; tests marked `ours_only` cover what Atropos
does not have (idempotent retries, unaligned counters, strict mode).
"""

from __future__ import annotations

import gzip
import os
import sys
import uuid
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.integration

ATROPOS_VENV = Path(os.environ.get("ATROPOS_VENV", "/work/.venv-atropos"))
SERVERS = ["ours"] + (["atropos"] if os.environ.get("FACTORY_CONFORMANCE_ATROPOS") == "1" else [])


@pytest.fixture(scope="module", params=SERVERS)
def api(request, tmp_path_factory):
    from factory.serve.client import ApiProcess

    root = tmp_path_factory.mktemp("conformance")
    port = free_port()
    if request.param == "ours":
        command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
                   "--store_root", str(root), "--log_level", "warning",
                   "--gzip_loopback", "true"]  # gzip to this host as well, as Atropos does (off by default here)
    else:
        run_api = ATROPOS_VENV / "bin" / "run-api"
        if not run_api.exists():
            pytest.skip(f"no atroposlib venv at {ATROPOS_VENV}")
        command = [str(run_api), "--port", str(port)]
    process = ApiProcess(command, port, log_path=str(root / "api.log")).start()
    process.kind = request.param
    yield process
    process.stop()


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api.url, timeout=30) as client:
        assert client.get("/reset_data").status_code == 200
        yield client


@pytest.fixture
def ours_only(api):
    if api.kind != "ours":
        pytest.skip("rollout-factory only")


def registration(batch_size: int = 8, **extra) -> dict:
    return {"wandb_group": "g", "wandb_project": "p", "batch_size": batch_size, "max_token_len": 256,
            "checkpoint_dir": "/ckpt", "save_checkpoint_interval": 5, "starting_step": 0, "num_steps": 20, **extra}


def env_request(name: str = "math", group_size: int = 2, **extra) -> dict:
    return {"max_token_length": 256, "desired_name": name, "weight": 1.0, "group_size": group_size, **extra}


def start(http, batch_size: int = 8, group_size: int = 2) -> int:
    """Trainer registers and polls once (training starts), then one env registers; returns its env_id."""
    assert isinstance(http.post("/register", json=registration(batch_size)).json()["uuid"], int)
    http.get("/batch")
    return http.post("/register-env", json=env_request(group_size=group_size)).json()["env_id"]


def group(env_id: int | None = 0, seed: int = 0, size: int = 2, **extra) -> dict:
    tokens = [[seed + 1, seed + 2, seed + 3 + k] for k in range(size)]
    return {"tokens": tokens, "masks": [[-100, t[1], t[2]] for t in tokens], "scores": [1.0, 0.0][:size] + [0.5] * (size - 2),
            "env_id": env_id, **extra}


def post_gzip(http, path: str, payload) -> httpx.Response:
    return http.post(path, content=gzip.compress(orjson.dumps(payload)),
                     headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


def batch(http) -> list[dict] | None:
    return http.get("/batch").json()["batch"]


def pick(groups: list[dict], *names: str) -> list[dict]:
    return [{name: g.get(name) for name in names} for g in groups]


# ---- trainer and env registration ----
def test_root_info_wandb_before_registration(http):
    assert http.get("/").json() == {"message": "AtroposLib API"}
    assert http.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert http.get("/wandb_info").json() == {"group": None, "project": None}
    status = http.get("/status").json()
    assert (status["current_step"], status["queue_size"]) == (0, 0)


def test_register_then_info_and_env_registration(http):
    reply = http.post("/register", json=registration(16))
    assert reply.status_code == 200 and isinstance(reply.json()["uuid"], int)
    assert http.get("/info").json() == {"batch_size": 16, "max_token_len": 256}
    assert http.get("/wandb_info").json() == {"group": "g", "project": "p"}
    assert http.post("/register-env", json=env_request()).json() == {"status": "wait for trainer to start"}
    assert batch(http) is None
    first = http.post("/register-env", json=env_request(min_batch_allocation=0.25)).json()
    assert first == {"status": "success", "env_id": 0, "wandb_name": "math_0", "checkpoint_dir": "/ckpt",
                     "starting_step": 0, "checkpoint_interval": 5, "num_steps": 20}
    second = http.post("/register-env", json=env_request()).json()
    assert (second["env_id"], second["wandb_name"]) == (1, "math_1")
    assert http.post("/disconnect-env", json={"env_id": 1}).json() == {"status": "success"}
    assert http.post("/disconnect-env", json={"env_id": 7}).json()["status"] == "failure"


def test_registration_without_required_fields_is_422(http):
    assert http.post("/register", json={"wandb_group": "g"}).status_code == 422
    assert http.post("/register-env", json={"desired_name": "x"}).status_code == 422


def test_status_env_weights_and_queue(http):
    http.post("/register", json=registration(8))
    http.get("/batch")
    heavy = http.post("/register-env", json=env_request("a", weight=3.0)).json()["env_id"]
    light = http.post("/register-env", json=env_request("b", weight=1.0, max_token_length=256)).json()["env_id"]
    http.post("/scored_data_list", json=[group(heavy, seed=s) for s in range(3)])
    # Atropos's env client sends GET /status-env with a JSON body.
    status = http.request("GET", "/status-env", json={"env_id": heavy}).json()
    assert status["env_weight"] == pytest.approx(0.75)
    assert (status["current_step"], status["self_queue_size"], status["queue_size"]) == (0, 3, 3)
    assert status["max_group_size"] == 2 and status["unallocated_fraction"] == 1.0
    other = http.request("GET", "/status-env", json={"env_id": light}).json()
    assert other["env_weight"] == pytest.approx(0.25) and other["self_queue_size"] == 0


# ---- posting groups ----
def test_single_and_list_posts_plain_and_gzip(http):
    env_id = start(http)
    assert http.post("/scored_data", json=group(env_id, seed=1)).json() == {"status": "received"}
    assert post_gzip(http, "/scored_data", group(env_id, seed=2)).json() == {"status": "received"}
    assert http.post("/scored_data_list", json=[group(env_id, seed=3)]).json() == {"status": "received", "groups_processed": 1}
    reply = post_gzip(http, "/scored_data_list", [group(env_id, seed=4), group(env_id, seed=5)])
    assert reply.json() == {"status": "received", "groups_processed": 2}
    assert http.get("/status").json()["queue_size"] == 5
    served = batch(http)
    assert [g["tokens"] for g in served] == [group(seed=s)["tokens"] for s in (1, 2, 3, 4)]


def test_repeated_identical_groups_are_all_kept_and_batched(http):
    env_id = start(http, batch_size=8)
    same = group(env_id, seed=9)
    assert http.post("/scored_data_list", json=[same] * 3).json()["groups_processed"] == 3
    assert http.post("/scored_data", json=same).json() == {"status": "received"}
    assert http.get("/status").json()["queue_size"] == 4
    served = batch(http)  # the trainer gets its batch of 8 sequences from four identical groups
    assert served is not None and [g["tokens"] for g in served] == [same["tokens"]] * 4


ODD_BUT_VALID = [
    {"messages": None},
    {"messages": []},
    {"messages": [[{"role": "user", "content": ""}], [{"role": "assistant", "content": "   "}]]},
    {"messages": [[{"role": "user", "content": "42"}], [{"role": "user", "content": 3.5, "reward": None}]]},
    {"advantages": [[0.5], [0.1, 0.2, 0.3, 0.4]]},
    {"ref_logprobs": [[-1.0, -2.0]]},
    {"inference_logprobs": [[1.0, -0.5]]},
    {"overrides": [{"set_advantage_to_zero": True}]},
    {"group_overrides": {"sft": True}, "overrides": [{"sft": True}, {"sft": False}]},
    {"generation_params": {"temperature": 0.7}, "images": None, "some_future_field": [1, 2]},
    {"scores": [1, 0]},
]


def test_odd_but_valid_bodies_are_taken_and_served_as_sent(http):
    env_id = start(http, batch_size=2 * len(ODD_BUT_VALID))
    posted = [group(env_id, seed=10 * i, **extra) for i, extra in enumerate(ODD_BUT_VALID)]
    for item in posted[:4]:
        assert http.post("/scored_data", json=item).json() == {"status": "received"}
    assert post_gzip(http, "/scored_data_list", posted[4:]).json()["groups_processed"] == len(posted) - 4
    served = batch(http)
    assert served is not None and len(served) == len(posted)
    fields = ("tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs", "messages", "overrides",
              "group_overrides", "generation_params", "env_id")
    expected = [{name: item.get(name) for name in fields} for item in posted]
    assert pick(served, *fields) == expected
    assert [g["scores"] for g in served] == [[float(s) for s in item["scores"]] for item in posted]


def test_messages_omitted_is_served_as_null(http):
    env_id = start(http, batch_size=2)
    http.post("/scored_data", json=group(env_id))
    assert batch(http)[0]["messages"] is None


@pytest.mark.parametrize(
    "body",
    [
        {"masks": [[1]], "scores": [1.0]},  # no tokens
        {"tokens": [[1]], "masks": [[1]], "scores": ["high"]},
        {"tokens": [["a"]], "masks": [[1]], "scores": [1.0]},
        {"tokens": [[1]], "masks": [[1]], "scores": [1.0], "messages": [[{"role": "user"}]]},
    ],
)
def test_what_atropos_refuses_is_422(http, body):
    assert http.post("/scored_data", json=body).status_code == 422
    assert http.post("/scored_data_list", json=[group(), body]).status_code == 422


def test_bad_gzip_is_400(http):
    reply = http.post("/scored_data", content=b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"})
    assert reply.status_code == 400


# ---- batches ----
def test_batch_gzip_response(http):
    env_id = start(http, batch_size=4)
    big = [group(env_id, seed=s, messages=[[{"role": "user", "content": "x" * 500}]] * 2) for s in range(2)]
    http.post("/scored_data_list", json=big)
    reply = http.get("/batch", headers={"Accept-Encoding": "gzip"})
    assert reply.headers.get("content-encoding") == "gzip"
    assert [g["tokens"] for g in reply.json()["batch"]] == [g["tokens"] for g in big]
    assert http.get("/status").json()["current_step"] == 1


def test_latest_example(http):
    env_id = start(http)
    http.post("/scored_data_list", json=[group(env_id, seed=1), group(env_id, seed=2)])
    assert http.get("/latest_example").json()["tokens"] == group(seed=2)["tokens"]


def test_reset_data_clears_registration_and_queue(http):
    env_id = start(http)
    http.post("/scored_data", json=group(env_id))
    reply = http.get("/reset_data")
    assert reply.status_code == 200 and reply.text == "Reset successful"
    assert reply.headers["content-type"].startswith("text/plain")
    assert http.get("/info").json()["batch_size"] == -1  # Atropos keeps max_token_len; ours resets it to -1 too
    assert http.get("/status").json()["queue_size"] == 0


# ---- rollout-factory only ----
def test_fresh_service_defaults(tmp_path, ours_only):
    from factory.serve.client import ApiProcess

    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(tmp_path), "--log_level", "warning"]
    with ApiProcess(command, port, log_path=str(tmp_path / "api.log")) as api:
        assert httpx.get(api.url + "/batch").json() == {
            "status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
        empty = httpx.get(api.url + "/latest_example").json()
        assert empty["tokens"] == [] and empty["scores"] == [] and empty["messages"] == []
        preflight = httpx.options(api.url + "/scored_data", headers={
            "Origin": "http://example.org", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://example.org")


def test_idempotency_key_retry_is_stored_once(http, ours_only):
    env_id = start(http, batch_size=4)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    for _ in range(3):  # a client retrying after lost acknowledgements
        assert http.post("/scored_data_list", json=[group(env_id), group(env_id)], headers=key).status_code == 200
    http.post("/scored_data", json=group(env_id, group_id="mine"))
    http.post("/scored_data", json=group(env_id, group_id="mine"))
    assert http.get("/status").json()["queue_size"] == 3


def test_unaligned_counters_in_status(http, ours_only):
    env_id = start(http)
    http.post("/scored_data_list", json=[group(env_id, advantages=[[0.5]]), group(env_id, messages=[], overrides=[{}])])
    unaligned = http.get("/status").json()["unaligned"]
    assert (unaligned["advantages"], unaligned["messages"], unaligned["overrides"], unaligned["masks"]) == (1, 1, 1, 0)


def test_strict_mode_refuses_unaligned_fields_naming_them(tmp_path, ours_only):
    from factory.serve.client import ApiProcess

    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(tmp_path), "--strict", "true", "--log_level", "warning"]
    with ApiProcess(command, port, log_path=str(tmp_path / "api.log")) as api:
        reply = httpx.post(api.url + "/scored_data_list", json=[group(), group(inference_logprobs=[[1.0]])])
        assert reply.status_code == 422
        assert reply.json()["detail"][0]["loc"] == ["body", 1, "inference_logprobs"]
        assert httpx.post(api.url + "/scored_data", json=group(messages=None)).status_code == 200
