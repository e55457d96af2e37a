"""The local CPU policy server as a subprocess: SGLang/OpenAI wire shapes, exact logprobs, 4xx on bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.local_server import ServerHandle, start_local_server
from factory.inference.tiny_model import make_tiny_policy
from factory.inference.types import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_policy(tmp_path_factory.mktemp("policy") / "a", seed=0)


@pytest.fixture(scope="module")
def server(policy_dir: Path) -> Iterator[ServerHandle]:
    with start_local_server(policy_dir) as handle:
        yield handle


def forward_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    table = torch.log_softmax(logits, -1)
    return [table[len(prompt) - 1 + k, t].item() for k, t in enumerate(output)]


def test_info_routes(server: ServerHandle, policy_dir: Path) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = httpx.get(server.base_url + "/v1/models").json()
    assert models["data"][0]["id"] == policy_dir.name
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["weight_version"] == "0" and info["model_path"] == str(policy_dir)


def test_generate_returns_n_rollouts_whose_logprobs_match_a_forward_pass(server: ServerHandle, policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [1, 20, 30, 40, 2]

    async def go():
        async with InferenceClient(InferenceConfig(base_url=server.base_url + "/v1")) as client:
            return await client.generate(prompt, n=3, sampling=SamplingParams(max_tokens=12, temperature=1.0))

    completions = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    assert len(completions) == 3
    for c in completions:
        assert c.prompt_token_ids == prompt and c.policy_version == 0 and c.finish_reason in ("stop", "length")
        assert len(c.output_logprobs) == len(c.output_token_ids) > 0
        expected = forward_logprobs(model, prompt, c.output_token_ids)
        assert max(abs(a - b) for a, b in zip(expected, c.output_logprobs)) < 1e-3


def test_openai_sdk_chat_and_completions_with_n_stop_and_logprobs(server: ServerHandle) -> None:
    async def go():
        sdk = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x")
        chat = await sdk.chat.completions.create(model="any", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                                 n=4, max_tokens=8, logprobs=True, temperature=1.0)
        comp = await sdk.completions.create(model="any", prompt="What is", n=2, max_tokens=8, logprobs=1, seed=5)
        again = await sdk.completions.create(model="any", prompt="What is", n=2, max_tokens=8, logprobs=1, seed=5)
        await sdk.close()
        return chat, comp, again

    chat, comp, again = asyncio.run(go())
    assert len(chat.choices) == 4 and all(len(c.logprobs.content) >= 1 for c in chat.choices)
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    assert len(comp.choices) == 2 and [c.text for c in comp.choices] == [c.text for c in again.choices]
    assert len(comp.choices[0].logprobs.token_logprobs) >= 1


def test_client_chat_keeps_the_servers_token_ids_and_logprobs(server: ServerHandle, policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    async def go():
        async with InferenceClient(InferenceConfig(base_url=server.base_url + "/v1")) as client:
            return await client.chat([{"role": "user", "content": "What is 2 + 3?"}], n=2,
                                     sampling=SamplingParams(max_tokens=8, stop=["9"]))

    completions = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    for c in completions:
        assert c.prompt_token_ids and c.output_token_ids and "9" not in c.text
        expected = forward_logprobs(model, c.prompt_token_ids, c.output_token_ids)
        assert max(abs(a - b) for a, b in zip(expected, c.output_logprobs)) < 1e-3


def test_generate_takes_text_and_batches_like_sglang(server: ServerHandle) -> None:
    single = httpx.post(server.base_url + "/generate", json={"text": "What is", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}}).json()
    assert isinstance(single, dict) and single["meta_info"]["prompt_tokens"] >= 1
    assert single["meta_info"]["finish_reason"]["type"] in ("stop", "length") and "output_token_logprobs" not in \
        single["meta_info"]
    batch = httpx.post(server.base_url + "/generate", json={"input_ids": [[1, 2], [3, 4, 5]], "return_logprob": True,
                                                            "sampling_params": {"max_new_tokens": 3, "n": 2}}).json()
    assert [item["meta_info"]["prompt_tokens"] for item in batch] == [2, 2, 3, 3]
    assert all(len(i["meta_info"]["output_token_logprobs"]) == len(i["output_ids"]) for i in batch)


def test_concurrent_requests_share_batches(server: ServerHandle) -> None:
    before = httpx.get(server.base_url + "/get_model_info").json()

    async def go():
        async with InferenceClient(InferenceConfig(base_url=server.base_url)) as client:
            return await asyncio.gather(*(client.generate([5, 6, 7 + i], n=2, sampling=SamplingParams(max_tokens=16))
                                          for i in range(16)))

    results = asyncio.run(go())
    after = httpx.get(server.base_url + "/get_model_info").json()
    assert all(len(r) == 2 for r in results)
    assert after["num_rows"] - before["num_rows"] == 32
    assert after["num_batches"] - before["num_batches"] < 16


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1, 99999]}, "input_ids"),
    ("/generate", {"sampling_params": {}}, "input_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": [""]}}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "model_path"),
])
def test_bad_input_is_a_4xx_naming_the_field(server: ServerHandle, path: str, body: dict, field: str) -> None:
    response = httpx.post(server.base_url + path, json=body)
    assert 400 <= response.status_code < 500
    assert field in response.text


def test_weight_update_under_load_stamps_each_rollout_with_the_weights_that_made_it(tmp_path: Path,
                                                                                      policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    new_dir = make_tiny_policy(tmp_path / "b", seed=1)
    models = {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for v, p in ((0, policy_dir), (1, new_dir))}
    prompt = [1, 20, 30, 40, 2]

    async def go(base_url: str):
        async with InferenceClient(InferenceConfig(base_url=base_url)) as client:
            sampling = SamplingParams(max_tokens=24)
            in_flight = [asyncio.create_task(client.generate(prompt, n=2, sampling=sampling)) for _ in range(12)]
            await asyncio.sleep(0.05)
            await client.update_weights_from_disk(str(new_dir), 1)
            after = await client.generate(prompt, n=2, sampling=sampling)
            return [c for t in in_flight for c in await t], after, client.policy_version

    with start_local_server(policy_dir) as handle:
        during, after, version = asyncio.run(go(handle.base_url))
    assert version == 1 and all(c.policy_version == 1 for c in after)
    for c in during + after:
        expected = forward_logprobs(models[c.policy_version], prompt, c.output_token_ids)
        assert max(abs(a - b) for a, b in zip(expected, c.output_logprobs)) < 1e-3
