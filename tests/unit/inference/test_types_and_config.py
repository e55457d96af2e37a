"""Sampling params, client config and answer parsing: what environments and the YAML/CLI layer rely on."""

from __future__ import annotations

import dataclasses

import pytest

from factory.config import ConfigError, build_config
from factory.inference.client import InferenceConfig
from factory.inference.endpoints import Endpoint, endpoint_root
from factory.inference.parse import parse_chat, parse_completions, parse_generate
from factory.inference.types import Completion, SamplingParams


def test_sampling_params_map_to_both_wire_formats() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=32, stop=["</answer>"], seed=7)
    assert params.openai_fields() == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 32, "stop": ["</answer>"],
                                      "seed": 7}
    assert params.sglang_fields() == {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 32,
                                      "stop": ["</answer>"], "sampling_seed": 7}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"stop": [""]}])
def test_bad_sampling_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_inference_config_from_cli_overrides_with_many_endpoints() -> None:
    cfg = build_config(InferenceConfig, cli_args=["--base_url", "[http://a:1/v1, http://b:2/v1]",
                                                  "--num_max_requests_at_once", "8"])
    assert cfg.urls == ["http://a:1/v1", "http://b:2/v1"] and cfg.num_max_requests_at_once == 8
    with pytest.raises(ConfigError, match="base_url"):
        build_config(InferenceConfig, values={"base_url": "localhost:30000"})
    with pytest.raises(ConfigError, match="server_type"):
        build_config(InferenceConfig, values={"server_type": "vllm-ish"})


def test_an_atropos_openai_section_loads_unchanged() -> None:
    atropos = {"model_name": "Qwen/Qwen3-1.7B", "base_url": "http://localhost:9001/v1", "api_key": "x",
               "num_requests_for_eval": 256, "server_type": "vllm", "timeout": 1200, "num_max_requests_at_once": 512,
               "rolling_buffer_length": 1000, "n_kwarg_is_ignored": True, "health_check": False,
               "tokenizer_name": "none"}
    cfg = build_config(InferenceConfig, values=atropos)
    assert cfg.server_type == "vllm" and cfg.n_kwarg_is_ignored and not cfg.health_check


def test_endpoint_root_strips_v1() -> None:
    assert endpoint_root("http://h:1/v1/") == "http://h:1"
    assert endpoint_root("http://h:1") == "http://h:1"


def test_parse_sglang_generate_list_and_version() -> None:
    ep = Endpoint("http://h:1", policy_version=3)
    data = [{"text": "ab", "output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "4",
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}},
            {"text": "c", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                            "weight_version": "default",
                                                            "output_token_logprobs": [[-0.3, 7, None]]}}]
    first, second = parse_generate(data, [1, 2], ep)
    assert first.output_token_ids == [5, 6] and first.output_logprobs == [-0.1, -0.2]
    assert first.finish_reason == "length" and first.policy_version == 4 and first.prompt_token_ids == [1, 2]
    assert second.finish_reason == "stop" and second.policy_version == 3  # non-integer version: the client's


def test_parse_openai_answers_without_token_ids() -> None:
    ep = Endpoint("http://h:1", policy_version=2)
    chat = parse_chat({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "logprobs": None}]}, ep)
    assert chat[0].text == "hi" and chat[0].output_token_ids is None and chat[0].output_logprobs is None
    assert chat[0].policy_version == 2
    comp = parse_completions({"choices": [{"text": "x", "finish_reason": "length",
                                           "logprobs": {"token_logprobs": [-1.0]}}]}, None, ep)
    assert comp[0].output_logprobs == [-1.0] and comp[0].finish_reason == "length"


def test_completion_init_sets_every_field_and_stays_frozen() -> None:
    """Completion's own __init__ sets every field, in its order, by position or keyword; the object stays frozen."""
    names = [field.name for field in dataclasses.fields(Completion)]
    values = ["text", [1, 2], [3], [-0.5], "length", 4, "http://h:1"]
    fast, made = Completion(*values), Completion(**dict(zip(names, values)))
    assert names == ["text", "prompt_token_ids", "output_token_ids", "output_logprobs", "finish_reason",
                     "policy_version", "endpoint"]
    assert fast == made and repr(fast) == repr(made) and vars(fast) == vars(made)
    assert dataclasses.replace(fast, text="other").text == "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.text = "changed"  # type: ignore[misc]


def test_a_rollout_from_a_completion_keeps_every_field() -> None:
    from environments.base import Item, Rollout

    made = Rollout.from_completion(Item(key="k", messages=[], answer=None),
                                   Completion("t", [1], [2], [-0.1], "stop", 3, "http://e"))
    assert made == Rollout(item_key="k", text="t", prompt_token_ids=[1], output_token_ids=[2], output_logprobs=[-0.1],
                           finish_reason="stop", policy_version=3, endpoint="http://e")
