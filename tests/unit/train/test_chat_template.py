"""The starter policy's chat template marks assistant turns with {% generation %} (TRL assistant-only loss)."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.inference.tiny_model import CHAT_TEMPLATE

POLICY = Path(__file__).resolve().parents[3] / "models" / "starter-policy"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<answer>4</answer>"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "<answer>6</answer>"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(POLICY)


def test_starter_policy_ships_the_marked_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert "{% generation %}" in (POLICY / "chat_template.jinja").read_text()


def test_rendering_is_plain_chatml(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
    assert text == expected
    prompt = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_assistant_mask_covers_answers_and_end_of_turn(tokenizer):
    out = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    kept = [i for i, keep in zip(out["input_ids"], out["assistant_masks"]) if keep]
    assert tokenizer.decode(kept) == "<answer>4</answer><|im_end|><answer>6</answer><|im_end|>"
