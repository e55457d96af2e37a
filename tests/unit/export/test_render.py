"""Rows come out in the layouts TRL reads as intended: messages, prompt/completion, prompt/chosen/rejected."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from factory.export.config import OutputConfig
from factory.export.render import Renderer, RenderError, split_conversation, trl_layout_problem
from factory.export.select import Pair
from factory.export.source import group_from_wire

from .conftest import scored


def _group(**kwargs):
    return group_from_wire(scored([1.0, 0.0], **kwargs).model_dump())


def test_split_conversation_takes_the_trailing_assistant_turns():
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert split_conversation(convo) == (convo[:2], convo[2:])
    assert split_conversation(convo[:2]) is None


def test_sft_conversational_rows_are_messages_with_metadata():
    renderer = Renderer("sft", OutputConfig(path="x"))
    row = renderer.sft_row(_group(), 0)
    assert row["messages"] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0-0"}]
    assert row["score"] == 1.0 and row["env"] == "math" and row["item_key"] == "math:0"
    assert set(row) == set(renderer.schema().names)
    assert "prompt" not in row


def test_sft_prompt_completion_rows_split_at_the_answer():
    renderer = Renderer("sft", OutputConfig(path="x", prompt_completion=True, extra_columns=False))
    row = renderer.sft_row(_group(), 1)
    assert row == {"prompt": [{"role": "user", "content": "q0"}], "completion": [{"role": "assistant", "content": "a0-1"}]}
    assert renderer.schema().names == ["prompt", "completion"]


def test_text_style_uses_the_chat_template(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    output = OutputConfig(path="x", style="text", tokenizer=str(tiny_tokenizer_dir), prompt_completion=True)
    row = Renderer("sft", output, tokenizer).sft_row(_group(), 0)
    assert row["prompt"] == "<|user|>q0<|end|><|assistant|>"
    assert row["completion"] == "a0-0<|end|>"
    dpo = Renderer("dpo", output.model_copy(update={"prompt_completion": False}), tokenizer)
    pair = dpo.dpo_row(_group(), Pair(0, 1))
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == ("<|user|>q0<|end|><|assistant|>", "a0-0<|end|>", "a0-1<|end|>")


def test_groups_without_messages_render_as_decoded_text_only(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    group = _group(messages=False)
    assert Renderer("sft", OutputConfig(path="x")).sft_row(group, 0) is None
    output = OutputConfig(path="x", style="text", tokenizer=str(tiny_tokenizer_dir), prompt_completion=True)
    row = Renderer("sft", output, tokenizer).sft_row(group, 0)
    assert row["prompt"] == tokenizer.decode([1, 2]) and row["completion"] == tokenizer.decode([10] * 4)


def test_dpo_conversational_rows_are_all_message_lists():
    renderer = Renderer("dpo", OutputConfig(path="x"))
    row = renderer.dpo_row(_group(), Pair(0, 1))
    for column in ("prompt", "chosen", "rejected"):
        assert isinstance(row[column], list) and all(isinstance(m, dict) for m in row[column])
    assert row["score_chosen"] == 1.0 and row["score_rejected"] == 0.0


def test_text_style_without_tokenizer_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="output.tokenizer"):
        OutputConfig(path="x", style="text")


def test_trl_layout_rules():
    assert "pre-tokenized" in trl_layout_problem(["messages", "input_ids"], "sft")
    assert "vision" in trl_layout_problem(["prompt", "chosen", "rejected", "images"], "dpo")
    assert "prompt/completion" in trl_layout_problem(["messages", "prompt"], "sft")
    assert trl_layout_problem(["prompt", "chosen"], "dpo")
    assert trl_layout_problem(["messages", "score", "group_id"], "sft") is None


@pytest.mark.parametrize("kind,prompt_completion", [("sft", False), ("sft", True), ("dpo", False)])
@pytest.mark.parametrize("style", ["conversational", "text"])
def test_every_layout_passes_trl_rules(kind, prompt_completion, style, tiny_tokenizer_dir):
    output = OutputConfig(path="x", style=style, tokenizer=str(tiny_tokenizer_dir), prompt_completion=prompt_completion)
    schema = Renderer(kind, output, tokenizer=object()).schema()
    assert trl_layout_problem(schema.names, kind) is None
    content = [f for f in schema if f.name in ("prompt", "completion", "chosen", "rejected", "messages", "text")]
    assert len({str(f.type) for f in content}) == 1  # all strings or all message lists


def test_content_hash_ignores_scores_and_metadata():
    renderer = Renderer("sft", OutputConfig(path="x"))
    a = renderer.sft_row(_group(), 0)
    b = dict(a, score=0.1, group_id="other", run_id="run-9")
    assert renderer.content_hash(a) == renderer.content_hash(b)
    assert renderer.content_hash(a) != renderer.content_hash(renderer.sft_row(_group(), 1))


def test_unloadable_tokenizer_names_the_option(tmp_path):
    from factory.export.render import load_tokenizer

    with pytest.raises(RenderError, match="output.tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))
