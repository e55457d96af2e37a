"""Turn SGLang-native and OpenAI-compatible answers into Completions, stamped with the policy version."""

from __future__ import annotations

from typing import Any

from factory.inference.endpoints import Endpoint
from factory.inference.types import Completion

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "eos": "stop", "tool_calls": "stop",
           "function_call": "stop", "content_filter": "stop"}


def weight_version_of(data: dict[str, Any]) -> int | None:
    """An integer weight version from an answer, or None (SGLang's default version is the string 'default')."""
    value = data.get("weight_version") if isinstance(data, dict) else None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _finish(reason: Any) -> str:
    if isinstance(reason, dict):  # SGLang native: {"type": "stop", "matched": ...}
        reason = reason.get("type")
    return _FINISH.get(str(reason), "stop") if reason is not None else "stop"


def parse_generate(data: Any, prompt_ids: list[int], ep: Endpoint) -> list[Completion]:
    """SGLang /generate: one dict, or a list of them when n > 1."""
    items = data if isinstance(data, list) else [data]
    prompt = list(prompt_ids)  # one copy of the sent ids, shared by the answer's completions as a chat answer's is
    root = ep.root
    completions = []
    for item in items:
        meta = item["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        output_ids = item.get("output_ids") or [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs] if pairs else None
        if logprobs is not None and len(logprobs) != len(output_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
        version = weight_version_of(meta)
        completions.append(Completion(item.get("text", ""), prompt, list(output_ids), logprobs,
                                      _finish(meta.get("finish_reason")),
                                      ep.policy_version if version is None else version, root))
    return completions


def _version(data: dict[str, Any], ep: Endpoint) -> int:
    version = weight_version_of(data)
    return ep.policy_version if version is None else version


def parse_chat(data: dict[str, Any], ep: Endpoint) -> list[Completion]:
    """OpenAI chat.completion; token ids where the server adds them (`token_ids`, `prompt_token_ids`).

    Written for its per-choice cost (a datagen worker parses 8 choices per group): the answer-level fields are
    read once, and a plain string finish reason is looked up without `_finish`'s call."""
    version = _version(data, ep)
    shared_prompt_ids = data.get("prompt_token_ids")
    root = ep.root
    completions = []
    for choice in data["choices"]:
        logprobs = choice.get("logprobs")
        content = (logprobs or {}).get("content")
        reason = choice.get("finish_reason")
        completions.append(Completion(
            choice["message"].get("content") or "",
            shared_prompt_ids or choice.get("prompt_token_ids"),
            choice.get("token_ids"),
            [float(t["logprob"]) for t in content] if content else None,
            _FINISH.get(reason, "stop") if type(reason) is str else _finish(reason),
            version,
            root,
        ))
    return completions


def parse_completions(data: dict[str, Any], prompt_ids: list[int] | None, ep: Endpoint) -> list[Completion]:
    """OpenAI text_completion; legacy `logprobs.token_logprobs`."""
    version = _version(data, ep)
    completions = []
    for choice in data["choices"]:
        token_lps = (choice.get("logprobs") or {}).get("token_logprobs")
        completions.append(Completion(
            text=choice.get("text") or "",
            prompt_token_ids=data.get("prompt_token_ids") or choice.get("prompt_token_ids") or prompt_ids,
            output_token_ids=choice.get("token_ids"),
            output_logprobs=[float(x) for x in token_lps] if token_lps else None,
            finish_reason=_finish(choice.get("finish_reason")), policy_version=version, endpoint=ep.root,
        ))
    return completions
