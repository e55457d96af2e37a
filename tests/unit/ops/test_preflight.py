"""Preflight: each wrong setting fails in seconds with one line naming the setting and its value."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from factory.preflight import PreflightError, check_endpoint, check_model_ref, check_store_writable, looks_like_path, preflight
from tests.conftest import free_port


@pytest.fixture
def fake_server():
    """A tiny SGLang-shaped server: /health 200 and /v1/models listing 'tiny'."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = {"/health": {}, "/v1/models": {"data": [{"id": "tiny"}]}, "/info": {"batch_size": -1}}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def tokenizer_dir(tmp_path: Path) -> Path:
    path = tmp_path / "policy"
    path.mkdir()
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.parametrize("value,is_path", [
    ("/abs/model", True), ("./model", True), ("../m", True), ("~/m", True), ("a/b/c", True), ("model/", True),
    ("Qwen/Qwen2-0.5B", False), ("gpt2", False),
])
def test_paths_and_hub_ids_are_told_apart(value, is_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_path(value) is is_path


def test_a_hub_like_value_under_an_existing_local_dir_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_like_path("models/starter-policyX")
    with pytest.raises(PreflightError) as error:
        check_model_ref("env.tokenizer_name", "models/starter-policyX")
    assert str(error.value).startswith("preflight: env.tokenizer_name='models/starter-policyX': no such directory")
    assert "\n" not in str(error.value)


def test_missing_local_tokenizer_dir_is_named_not_taken_as_a_hub_id(tmp_path):
    with pytest.raises(PreflightError, match=r"env.tokenizer_name=.*no such directory"):
        check_model_ref("env.tokenizer_name", str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PreflightError, match="has none of tokenizer_config.json"):
        check_model_ref("env.tokenizer_name", str(empty))
    check_model_ref("env.tokenizer_name", str(tokenizer_dir(tmp_path)))


def test_offline_mode_needs_hub_ids_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(PreflightError, match="not in the local Hugging Face cache"):
        check_model_ref("env.tokenizer_name", "org/not-cached")
    (tmp_path / "models--org--cached").mkdir()
    check_model_ref("env.tokenizer_name", "org/cached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    check_model_ref("env.tokenizer_name", "org/not-cached")  # online: left to the hub


def test_store_that_cannot_be_created_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PreflightError, match=r"^preflight: datagen.store_root='.*file/store': not writable"):
        check_store_writable("datagen.store_root", str(blocker / "store"))
    check_store_writable("datagen.store_root", str(tmp_path / "ok" / "store"))
    assert list((tmp_path / "ok" / "store").iterdir()) == []


def test_unreachable_endpoint_fails_in_seconds_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/v1"
    started = time.monotonic()
    with pytest.raises(PreflightError) as error:
        check_endpoint(url, timeout=2)
    assert time.monotonic() - started < 5
    assert str(error.value).startswith(f"preflight: openai.base_url={url!r}: not reachable")


def test_endpoint_must_serve_the_configured_model(fake_server):
    check_endpoint(fake_server + "/v1", model_name="tiny", server_type="vllm")
    check_endpoint(fake_server, model_name="default", server_type="openai")
    check_endpoint(fake_server, model_name="big")  # SGLang's /generate ignores the name
    with pytest.raises(PreflightError, match=r"openai.model_name='big': not served by .* \(it serves tiny\)"):
        check_endpoint(fake_server, model_name="big", server_type="vllm")


def job(tmp_path, **sections):
    from flows.datagen import build_job_config

    values = {"datagen": {"store_root": str(tmp_path / "store")}, **sections}
    return build_job_config("environments.intern_bootcamp:InternBootcampEnv", values=values)


def test_preflight_of_a_whole_job(fake_server, tmp_path):
    tok = str(tokenizer_dir(tmp_path))
    preflight(job(tmp_path, openai={"base_url": fake_server}, env={"tokenizer_name": tok}))
    with pytest.raises(PreflightError, match="env.tokenizer_name=None: token in/out"):
        preflight(job(tmp_path, openai={"base_url": fake_server}))
    with pytest.raises(PreflightError, match="serve.api_url="):
        preflight(job(tmp_path, openai={"base_url": fake_server}, env={"tokenizer_name": tok},
                      serve={"api_url": f"http://127.0.0.1:{free_port()}"}), mode="serve")
    preflight(job(tmp_path, openai={"base_url": fake_server}, env={"tokenizer_name": tok},
                  serve={"api_url": fake_server}), mode="serve")


def test_node_local_endpoints_are_left_to_the_slurm_workers(fake_server, tmp_path):
    tok = str(tokenizer_dir(tmp_path))
    preflight(job(tmp_path, openai={"base_url": "http://node-local/v1"}, env={"tokenizer_name": tok}))
    with pytest.raises(PreflightError, match="not reachable"):  # other URLs are still checked beside it
        preflight(job(tmp_path, openai={"base_url": ["http://node-local/v1", f"http://127.0.0.1:{free_port()}"]},
                      env={"tokenizer_name": tok}))


def test_preflight_wait_polls_an_endpoint_that_comes_up(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PreflightError):
        preflight(job(tmp_path, openai={"base_url": url}, env={"tokenizer_name": str(tokenizer_dir(tmp_path))}),
                  wait_s=2)
    assert 2 <= time.monotonic() - started < 8


# ---- dataset and judge access -------------------------------------------------------------------------------------

class EnvWith:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_a_hub_dataset_not_cached_while_offline_fails_in_one_line_at_once(tmp_path, monkeypatch):
    from factory.preflight import check_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    started = time.monotonic()
    with pytest.raises(PreflightError) as error:
        check_dataset(EnvWith(dataset_name="openai/gsm8k-not-here", data_file=None))
    assert time.monotonic() - started < 2
    message = str(error.value)
    assert message.startswith("preflight: env.dataset_name='openai/gsm8k-not-here': is a hub dataset that is not in")
    assert "env.data_file" in message and "\n" not in message
    (tmp_path / "hf" / "datasets" / "openai___gsm8k-not-here").mkdir(parents=True)
    check_dataset(EnvWith(dataset_name="openai/gsm8k-not-here", data_file=None))  # cached: fine


def test_a_local_data_file_wins_and_must_exist(tmp_path):
    from factory.preflight import check_dataset

    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    check_dataset(EnvWith(dataset_name="openai/never-fetched", data_file=str(rows)))
    with pytest.raises(PreflightError, match="env.data_file=.*no such file"):
        check_dataset(EnvWith(dataset_name="x/y", data_file=str(tmp_path / "missing.jsonl")))
    check_dataset(EnvWith(task_name="RandomTask"))  # a generated env has no dataset


def test_an_unreachable_hub_while_online_fails_within_the_timeout(monkeypatch):
    from factory.preflight import check_dataset

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    with pytest.raises(PreflightError, match="the hub .* is not reachable"):
        check_dataset(EnvWith(dataset_name="openai/gsm8k", data_file=None), timeout=2)


def test_the_judge_endpoint_must_answer(fake_server):
    from factory.inference.client import InferenceConfig
    from factory.preflight import check_judge

    check_judge(EnvWith(judge_block=None, judge=InferenceConfig(base_url=fake_server + "/v1", server_type="openai",
                                                               model_name="tiny")))
    check_judge(EnvWith(tokenizer_name=None))  # not a judge env: nothing to check
    dead = f"http://127.0.0.1:{free_port()}/v1"
    started = time.monotonic()
    with pytest.raises(PreflightError) as error:
        check_judge(EnvWith(judge_block=None, judge=InferenceConfig(base_url=dead, server_type="openai")), timeout=2)
    assert time.monotonic() - started < 5
    assert str(error.value).startswith(f"preflight: env.judge.base_url='{dead}': the judge endpoint is not reachable")
    with pytest.raises(PreflightError, match="env.judge.base_url=None: this env scores with a judge"):
        check_judge(EnvWith(judge_block=None, judge=None))


def test_the_endpoint_check_reuses_one_verifying_tls_context(monkeypatch):
    """httpx loads the CA bundle for every new Client (~25 ms of CPU); preflight runs on every flow call."""
    import ssl

    import httpx

    from factory import preflight

    seen = []
    real = httpx.Client

    def client(*args, **kwargs):
        seen.append(kwargs.get("verify"))
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "Client", client)
    for _ in range(2):
        with pytest.raises(preflight.PreflightError):  # nothing listens there: the check still fails as it did
            preflight.check_endpoint("http://127.0.0.1:9/v1", server_type="openai", timeout=0.5)
    assert len(seen) == 2 and seen[0] is seen[1] is preflight.tls()
    assert isinstance(seen[0], ssl.SSLContext) and seen[0].verify_mode == ssl.CERT_REQUIRED
