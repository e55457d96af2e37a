"""Chat-mode tokenization: one batched encode per group gives exactly what per-text `encode` gave."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.inference.types import Completion
from tasks.generate import ClientSampler, encode_texts, load_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from factory.inference.tiny_model import make_tiny_policy

    path = tmp_path_factory.mktemp("policy") / "tiny"
    make_tiny_policy(path)
    return load_tokenizer(str(path))


def test_batched_encode_equals_one_encode_per_text(tokenizer):
    texts = ["<answer>42</answer>", "", " two  spaces\n\n", "<|im_end|> special <|endoftext|>", "é 🎉 ∑", "a" * 50]
    assert encode_texts(tokenizer, texts) == [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_group_is_tokenized_keeping_server_ids_and_encoding_the_rest(tokenizer):
    sampler = ClientSampler(client=None, tokenizer=tokenizer, api="chat")
    messages = [{"role": "user", "content": "Compute 1+2."}]
    from_server = Completion(text="ignored", prompt_token_ids=[7, 8], output_token_ids=[1, 2, 3],
                             output_logprobs=[-0.1, -0.2, -0.3], finish_reason="stop", policy_version=0, endpoint="e")
    local = Completion(text="<answer>3</answer>", prompt_token_ids=None, output_token_ids=None,
                       output_logprobs=[-0.5], finish_reason="stop", policy_version=0, endpoint="e")
    cut = Completion(text="<answer>", prompt_token_ids=None, output_token_ids=None, output_logprobs=None,
                     finish_reason="length", policy_version=0, endpoint="e")
    kept, encoded, truncated = sampler._tokenize_all(messages, [from_server, local, cut])
    assert kept.output_token_ids == [1, 2, 3] and kept.output_logprobs == [-0.1, -0.2, -0.3]
    assert kept.prompt_token_ids == [7, 8]  # the server's ids are not re-encoded
    expected = tokenizer.encode("<answer>3</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert encoded.output_token_ids == expected
    assert encoded.output_logprobs is None  # one logprob for several tokens: dropped, not misaligned
    assert encoded.prompt_token_ids == sampler._ids(messages)
    assert truncated.output_token_ids == tokenizer.encode("<answer>", add_special_tokens=False)  # no EOS on length
