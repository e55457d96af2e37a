"""Issue 33's cheaper tokenize/mask path gives exactly the ids, masks and logprobs of the code it replaced.

Each `before_*` function below is the replaced code, kept as the oracle: templating with
`apply_chat_template(tokenize=True)`, completions through `dataclasses.replace`, masks through a per-token zip.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from environments.base import Rollout, text_messages
from environments.groups import MASK_IGNORE
from factory.inference.types import Completion
from tasks.generate import ClientSampler, encode_texts, load_tokenizer, prompt_ids, serial_tokenizers
from tasks.group import sequence_tokens

REPO = Path(__file__).resolve().parents[3]

CONVERSATIONS = [
    [{"role": "user", "content": "Compute 99+74. Put the answer in <answer></answer>."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<answer>4</answer>"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "literal <|im_end|> and <|endoftext|> in user text"}],
    [{"role": "user", "content": "é 🎉 ∑  two  spaces\n\n\ttab"}],
    [{"role": "user", "content": [{"type": "text", "text": "What is shown?"},
                                  {"type": "image_url", "image_url": {"url": "x"}}]}],
]


def before_prompt_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(text_messages(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def before_sequence_tokens(rollout):
    prompt = list(rollout.prompt_token_ids or [])
    output = list(rollout.output_token_ids or [])
    trained = rollout.output_mask if rollout.output_mask is not None else [True] * len(output)
    masks = [MASK_IGNORE] * len(prompt) + [t if keep else MASK_IGNORE for t, keep in zip(output, trained)]
    logprobs = None
    if rollout.output_logprobs is not None and len(rollout.output_logprobs) == len(output):
        logprobs = [1.0] * len(prompt) + [float(x) if keep else 1.0
                                          for x, keep in zip(rollout.output_logprobs, trained)]
    return prompt + output, masks, logprobs


def before_tokenize_all(sampler, messages, completions, prompt=None):
    missing = [c.text for c in completions if c.output_token_ids is None]
    encoded = iter([sampler.tokenizer.encode(t, add_special_tokens=False) for t in missing])
    prompt = None if all(c.prompt_token_ids for c in completions) else (
        prompt or before_prompt_ids(sampler.tokenizer, messages))
    out = []
    for c in completions:
        output, logprobs = c.output_token_ids, c.output_logprobs
        if output is None:
            output = list(next(encoded))
            if c.finish_reason == "stop" and sampler.tokenizer.eos_token_id is not None:
                output.append(sampler.tokenizer.eos_token_id)
        if logprobs is not None and len(logprobs) != len(output):
            logprobs = None
        out.append(dataclasses.replace(c, prompt_token_ids=c.prompt_token_ids or prompt, output_token_ids=output,
                                       output_logprobs=logprobs))
    return out


@pytest.mark.parametrize("messages", CONVERSATIONS,
                         ids=["one-turn", "multi-turn", "empty", "special", "unicode", "parts"])
def test_prompt_ids_are_apply_chat_templates_ids(tokenizer, messages):
    assert prompt_ids(tokenizer, messages) == before_prompt_ids(tokenizer, messages)


def test_a_tokenizer_without_a_chat_template_fails_as_before(tiny):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tiny))
    plain.chat_template = None
    with pytest.raises(ValueError) as before:
        before_prompt_ids(plain, CONVERSATIONS[0])
    with pytest.raises(ValueError) as now:
        prompt_ids(plain, CONVERSATIONS[0])
    assert str(now.value) == str(before.value)


def test_backend_truncation_is_not_applied(tiny):
    """A tokenizer.json with truncation set: transformers' encode turns it off, so the direct Rust call must not
    be used (it would cut the ids)."""
    from transformers import AutoTokenizer

    cut = AutoTokenizer.from_pretrained(str(tiny))
    cut.backend_tokenizer.enable_truncation(max_length=3)
    texts = ["<answer>12345</answer>", "a longer answer than three tokens"]
    assert encode_texts(cut, texts) == [cut.encode(t, add_special_tokens=False) for t in texts]
    assert all(len(ids) > 3 for ids in encode_texts(cut, texts))


def test_a_slow_tokenizer_goes_through_transformers(tiny):
    fast = load_tokenizer(str(tiny))

    class Slow:  # what encode_texts sees of a tokenizer without a Rust backend
        is_fast = False

        def __call__(self, texts, add_special_tokens):
            return fast(texts, add_special_tokens=add_special_tokens)

    texts = ["<answer>7</answer>", ""]
    assert encode_texts(Slow(), texts) == [fast.encode(t, add_special_tokens=False) for t in texts]


def completion(text, prompt=None, output=None, logprobs=None, finish="stop"):
    return Completion(text=text, prompt_token_ids=prompt, output_token_ids=output, output_logprobs=logprobs,
                      finish_reason=finish, policy_version=3, endpoint="http://e")


GROUPS = {
    "local": [completion("<answer>4</answer>"), completion("<answer>5</answer>", logprobs=[-0.1])],
    "empty completion": [completion(""), completion("", finish="length")],
    "truncated": [completion("<answer>12", finish="length"), completion("<answer>1</answer>", finish="abort")],
    "server ids": [completion("x", prompt=[5, 6], output=[1, 2], logprobs=[-0.1, -0.2]),
                   completion("y", prompt=[5, 6], output=[3], logprobs=[-0.3, -0.4])],
    "mixed": [completion("x", prompt=[5, 6], output=[1, 2]), completion("<answer>3</answer>"),
              completion("z", output=[9], logprobs=[-1.0])],
}


@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("given_prompt", [None, [11, 12, 13]], ids=["templated", "episode-prompt"])
def test_group_tokenization_is_as_before(tokenizer, name, given_prompt):
    sampler = ClientSampler(client=None, tokenizer=tokenizer, api="chat")
    messages = CONVERSATIONS[1]
    now = sampler._tokenize_all(messages, GROUPS[name], given_prompt)
    assert now == before_tokenize_all(sampler, messages, GROUPS[name], given_prompt)


def test_with_tokens_covers_every_completion_field():
    """tasks.generate._with_tokens builds a Completion field by field: a new field must be added there too."""
    assert [f.name for f in dataclasses.fields(Completion)] == [
        "text", "prompt_token_ids", "output_token_ids", "output_logprobs", "finish_reason", "policy_version",
        "endpoint"]


def test_serial_tokenizers_keeps_an_explicit_setting(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    serial_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    serial_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


ids = st.lists(st.integers(0, 300_000), max_size=12)


@st.composite
def rollouts(draw):
    prompt = draw(st.none() | ids)
    output = draw(st.none() | ids)
    n = len(output or [])
    mask = draw(st.none() | st.lists(st.booleans(), min_size=max(0, n - 2), max_size=n + 1))  # multi-turn segments
    values = st.floats(-20, 0) | st.integers(-5, 0)
    logprobs = draw(st.none() | st.lists(values, min_size=max(0, n - 1), max_size=n + 1))
    return Rollout("k", "t", prompt, output, logprobs, "stop", 0, messages=None, output_mask=mask)


@settings(max_examples=400, deadline=None)
@given(rollouts())
def test_sequence_tokens_are_as_before(rollout):
    now, before = sequence_tokens(rollout), before_sequence_tokens(rollout)
    assert now == before
    assert [type(x) for x in now[2] or []] == [type(x) for x in before[2] or []]  # floats stay floats


def test_multi_turn_masks_hide_env_turns():
    r = Rollout("k", "t", [1, 2], [10, 11, 50, 51, 12], [-0.1, -0.2, -9.0, -9.0, -0.3], "stop", 0,
                output_mask=[True, True, False, False, True])
    tokens, masks, logprobs = sequence_tokens(r)
    assert tokens == [1, 2, 10, 11, 50, 51, 12]
    assert masks == [MASK_IGNORE, MASK_IGNORE, 10, 11, MASK_IGNORE, MASK_IGNORE, 12]
    assert logprobs == [1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3]


def test_the_start_up_heap_is_frozen_once_per_process():
    code = ("import gc; from factory.datagen.heap import freeze_startup_heap as f; "
            "assert gc.get_freeze_count() == 0; assert f(); n = gc.get_freeze_count(); assert n > 0; "
            "assert not f() and gc.get_freeze_count() == n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
