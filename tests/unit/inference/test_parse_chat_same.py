"""parse_chat, written for its per-choice cost, reads every answer as the version before it did."""

from __future__ import annotations

import itertools

from factory.inference.endpoints import Endpoint
from factory.inference.parse import _finish, _version, parse_chat
from factory.inference.types import Completion


def parse_chat_before(data, ep):
    version = _version(data, ep)
    completions = []
    for choice in data["choices"]:
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = [float(t["logprob"]) for t in content] if content else None
        completions.append(Completion(
            text=choice["message"].get("content") or "",
            prompt_token_ids=data.get("prompt_token_ids") or choice.get("prompt_token_ids"),
            output_token_ids=choice.get("token_ids"), output_logprobs=logprobs,
            finish_reason=_finish(choice.get("finish_reason")), policy_version=version, endpoint=ep.root,
        ))
    return completions


def test_every_kind_of_choice_parses_as_before():
    ep = Endpoint("http://x:1", policy_version=4)
    reasons = ["stop", "length", "abort", "eos", "tool_calls", "weird", None, {"type": "length", "matched": 2},
               {"matched": 1}, 3]
    logprobs = [None, {}, {"content": None}, {"content": []}, {"content": [{"logprob": -1}, {"logprob": -0.25}]}]
    contents = ["hi", "", None]
    choices = []
    for reason, lp, content, ids in itertools.product(reasons, logprobs, contents, [None, [5, 6], []]):
        choice = {"message": {"role": "assistant", "content": content}, "finish_reason": reason, "logprobs": lp}
        if ids is not None:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = [9, *ids]
        choices.append(choice)
    for extra in ({}, {"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": []}, {"weight_version": "7"},
                  {"weight_version": "default"}):
        data = {"choices": choices, **extra}
        assert parse_chat(data, ep) == parse_chat_before(data, ep)
    assert parse_chat({"choices": []}, ep) == []
