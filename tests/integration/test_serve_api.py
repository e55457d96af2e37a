"""Contract tests of every batching-API endpoint against a real `run-api` process: shapes, codes, gzip, auth, limits."""

from __future__ import annotations

import gzip
import sys

import httpx
import orjson
import pytest

from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-store")
    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(root), "--api_token", TOKEN, "--max_body_mb", "1", "--log_level", "warning",
               "--gzip_loopback", "true"]  # gzip to this host too, so the gzip paths are the ones tested
    process = ApiProcess(command, port, log_path=str(root / "api.log")).start(headers=AUTH)
    yield process
    process.stop()


@pytest.fixture
def http(api):
    with httpx.Client(base_url=api.url, headers=AUTH, timeout=30) as client:
        client.get("/reset_data")
        yield client


def wire(n: int, **kwargs) -> list[dict]:
    return [orjson.loads(orjson.dumps(g.wire_dict())) for g in synthetic_groups(n, **kwargs)]


def start_training(http, batch_size=8) -> int:
    assert http.post("/register", json={
        "wandb_group": "g", "wandb_project": "p", "batch_size": batch_size, "max_token_len": 512,
        "checkpoint_dir": "/ckpt", "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 50,
    }).status_code == 200
    assert http.get("/batch").json() == {"batch": None}
    return http.post("/register-env", json={
        "max_token_length": 512, "desired_name": "math", "weight": 1.0, "group_size": 4,
    }).json()["env_id"]


def test_root_and_unregistered_defaults(http):
    assert http.get("/").json() == {"message": "AtroposLib API"}
    assert http.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert http.get("/wandb_info").json() == {"group": None, "project": None}
    assert http.get("/batch").json() == {
        "status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
    assert http.get("/status").json()["current_step"] == 0
    assert set(http.get("/latest_example").json()) >= {"tokens", "masks", "scores"}


def test_register_and_register_env(http):
    reply = http.post("/register", json={
        "wandb_group": "g", "wandb_project": "p", "batch_size": 8, "max_token_len": 512,
        "checkpoint_dir": "/ckpt", "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 50})
    assert isinstance(reply.json()["uuid"], int)
    assert http.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
    assert http.get("/wandb_info").json() == {"group": "g", "project": "p"}
    env = {"max_token_length": 512, "desired_name": "math", "weight": 1.0, "group_size": 4}
    assert http.post("/register-env", json=env).json() == {"status": "wait for trainer to start"}
    http.get("/batch")
    first, second = http.post("/register-env", json=env).json(), http.post("/register-env", json=env).json()
    assert first == {"status": "success", "env_id": 0, "wandb_name": "math_0", "checkpoint_dir": "/ckpt",
                     "starting_step": 0, "checkpoint_interval": 10, "num_steps": 50}
    assert (second["env_id"], second["wandb_name"]) == (1, "math_1")
    assert http.post("/disconnect-env", json={"env_id": 1}).json() == {"status": "success"}
    assert http.post("/disconnect-env", json={"env_id": 9}).json()["status"] == "failure"


def test_bad_registration_names_the_field(http):
    reply = http.post("/register", json={"wandb_group": "g"})
    assert reply.status_code == 422
    assert ["body", "batch_size"] in [e["loc"] for e in reply.json()["detail"]]
    reply = http.post("/register-env", json={"max_token_length": 1, "desired_name": "x", "weight": 1, "group_size": 0})
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "group_size"]


def test_scored_data_round_trip_with_gzip_both_ways(http):
    env_id = start_training(http)
    groups = [{**g, "env_id": env_id} for g in wire(3, group_size=4, seq_len=64)]
    assert http.post("/scored_data", json=groups[0]).json() == {"status": "received"}
    body = gzip.compress(orjson.dumps(groups[1:]))
    reply = http.post("/scored_data_list", content=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert reply.json() == {"status": "received", "groups_processed": 2}
    assert http.get("/status").json()["queue_size"] == 3
    assert http.get("/latest_example").json()["tokens"] == groups[2]["tokens"]

    reply = http.get("/batch", headers={"Accept-Encoding": "gzip"})
    assert reply.headers["content-encoding"] == "gzip"
    assert reply.json()["batch"] == groups[:2]
    assert http.get("/status").json() == {**http.get("/status").json(), "current_step": 1, "queue_size": 1}
    http.post("/scored_data", json={**groups[2], "tokens": groups[2]["tokens"], "scores": [0.0, 1.0, 0.5, 0.25]})
    reply = http.get("/batch", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in reply.headers and len(reply.json()["batch"]) == 2


def test_status_env_get_with_json_body_and_query(http):
    env_id = start_training(http)
    env = EnvClient(http.base_url.__str__(), headers=AUTH)
    env.env_id = env_id
    env.post(wire(2, group_size=4, seq_len=16))
    status = http.request("GET", "/status-env", json={"env_id": env_id}).json()
    assert status == {"current_step": 0, "queue_size": 2, "unallocated_fraction": 1.0, "self_queue_size": 2,
                      "max_group_size": 4, "env_weight": 1.0}
    assert http.get("/status-env", params={"env_id": env_id}).json() == status
    assert http.request("GET", "/status-env", json={"env_id": 42}).status_code == 404
    missing = http.request("GET", "/status-env", json={})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "env_id"]


@pytest.mark.parametrize(
    "mutate, field",
    [
        # Lengths that don't line up are stored as Atropos stores them (see test_serve_conformance); types are checked.
        (lambda g: g.update(masks=[["x"]] * 4), "masks"),
        (lambda g: g.update(scores="high"), "scores"),
        (lambda g: g.pop("tokens"), "tokens"),
        (lambda g: g.update(messages=[[{"role": "user"}]] * 4), "messages"),
    ],
)
def test_malformed_groups_get_422_naming_the_field(http, mutate, field):
    group = wire(1, group_size=4, seq_len=8)[0]
    mutate(group)
    reply = http.post("/scored_data", json=group)
    assert reply.status_code == 422
    detail = reply.json()["detail"]
    assert any(field in ".".join(map(str, e["loc"])) or field in e["msg"] for e in detail), detail
    reply = http.post("/scored_data_list", json=[wire(1, seq_len=8)[0], group])
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"][:2] == ["body", 1]


def test_unknown_keys_are_ignored_as_atropos_does(http):
    group = {**wire(1, group_size=2, seq_len=8)[0], "custom_note": "x"}
    assert http.post("/scored_data", json=group).json() == {"status": "received"}


def test_bad_bodies_are_4xx_never_500(http):
    assert http.post("/scored_data", content=b"{not json").status_code == 422
    assert http.post("/scored_data_list", json={"tokens": []}).status_code == 422
    bad_gzip = http.post("/scored_data", content=b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"})
    assert bad_gzip.status_code == 400
    assert http.post("/scored_data", content=b"x" * (2 << 20)).status_code == 413
    bomb = gzip.compress(b"[" + b" " * (4 << 20) + b"]")
    assert len(bomb) < (1 << 20)
    assert http.post("/scored_data_list", content=bomb, headers={"Content-Encoding": "gzip"}).status_code == 413
    start_training(http, batch_size=2)
    too_big = http.post("/scored_data", json=wire(1, group_size=4, seq_len=8)[0])
    assert too_big.status_code == 422 and "batch_size" in too_big.json()["detail"][0]["msg"]


def test_bearer_token_required(api):
    assert httpx.get(api.url + "/status").status_code == 401
    assert httpx.get(api.url + "/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(api.url + "/status", headers=AUTH).status_code == 200


def test_posts_get_the_same_answers_on_the_fast_path_and_through_cors(http):
    """Posts without an Origin header are answered beside FastAPI (FastPosts); a browser's go through the full
    stack for its CORS headers. Both check the token, gunzip, refuse bad bodies the same way and store the groups."""
    url = str(http.base_url).rstrip("/") + "/scored_data"
    group = wire(1, group_size=4, seq_len=8)[0]
    body = gzip.compress(orjson.dumps(group))
    for origin in ({}, {"Origin": "http://example.org"}):
        gz = {**origin, "Content-Encoding": "gzip", "Content-Type": "application/json"}
        assert httpx.post(url, content=body, headers=gz).status_code == 401
        assert httpx.post(url, content=body, headers={**gz, "Authorization": "Bearer wrong"}).status_code == 401
        reply = httpx.post(url, content=body, headers={**gz, **AUTH})
        assert reply.status_code == 200 and reply.json() == {"status": "received"}
        if origin:
            assert reply.headers["access-control-allow-origin"] in ("*", "http://example.org")
        assert httpx.post(url, content=b"\x1f\x8bnot gzip", headers={**gz, **AUTH}).status_code == 400
        assert httpx.post(url, content=b"{", headers={**origin, **AUTH}).status_code == 422
        many = httpx.post(url + "_list", content=gzip.compress(orjson.dumps([group, group])), headers={**gz, **AUTH})
        assert many.json() == {"status": "received", "groups_processed": 2}
    assert http.get("/status").json()["queue_size"] == 6


def test_reset_data(http):
    start_training(http)
    http.post("/scored_data", json=wire(1, group_size=4, seq_len=8)[0])
    reply = http.get("/reset_data")
    assert reply.text == "Reset successful" and reply.headers["content-type"].startswith("text/plain")
    assert http.get("/status").json()["queue_size"] == 0
    assert http.get("/info").json() == {"batch_size": -1, "max_token_len": -1}


def test_trainer_client_pulls_what_env_client_posts(api, http):
    start_training(http)
    trainer = TrainerClient(api.url, headers=AUTH)
    env = EnvClient(api.url, headers=AUTH)
    env.register("code", group_size=2)
    env.post(wire(4, group_size=2, seq_len=8, seed=7))
    assert [len(g["tokens"]) for g in trainer.batch()] == [2, 2, 2, 2]


def test_arrow_batches_count_steps_as_json_batches_do(http):
    """A trainer asking for Arrow gets the same batches, one step each; bodies without rows stay JSON."""
    import pyarrow as pa

    arrow = {"Accept": "application/vnd.apache.arrow.stream, application/json;q=0.5", "Accept-Encoding": "identity"}
    assert http.get("/batch", headers=arrow).json()["message"].startswith("Trainer not registered")
    env_id = start_training(http)
    assert http.get("/batch", headers=arrow).json() == {"batch": None}
    posted = [{**g, "env_id": env_id} for g in wire(6, group_size=4, seq_len=16)]
    assert http.post("/scored_data_list", json=posted).status_code == 200
    served = []
    for call in range(3):
        reply = http.get("/batch", headers=arrow if call != 1 else {"Accept-Encoding": "gzip"})
        if call != 1:
            assert reply.headers["content-type"] == "application/vnd.apache.arrow.stream"
            served += pa.ipc.open_stream(reply.content).read_all().column("tokens").to_pylist()
        else:
            assert reply.headers["content-type"] == "application/json"
            served += [g["tokens"] for g in reply.json()["batch"]]
        assert http.get("/status").json()["current_step"] == call + 1
    assert http.get("/batch", headers=arrow).json() == {"batch": None}
    status = http.get("/status").json()
    assert (status["current_step"], status["queue_size"]) == (3, 0)
    assert sorted(served) == sorted(g["tokens"] for g in posted)
