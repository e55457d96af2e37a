"""Atropos's line layout: the rows and bytes atroposlib 0.4.0's sft/dpo-gen write, worked out by hand here.

(tests/integration/test_export_api.py also runs atroposlib's own CLIs side by side when its venv is built.)
"""

from __future__ import annotations

import json

import pytest

from factory.export import DpoExportConfig, DpoSelectionConfig, OutputConfig, SelectionConfig, SftExportConfig
from factory.export.atropos import common_prefix
from factory.export.pipeline import NoRowsError, export_dpo, export_sft
from factory.export.source import group_from_wire


class LetterTokenizer:
    """Token id i decodes to the i-th lowercase letter; enough to check prefixes and completions."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _group(scores, completions, prompt=(0, 1), messages=True):
    tokens = [list(prompt) + list(c) for c in completions]
    return group_from_wire({
        "tokens": tokens,
        "masks": [[-100] * len(prompt) + list(c) for c in completions],
        "scores": scores,
        "messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"é{k}"}]
                     for k in range(len(scores))] if messages else None,
    })


def _sft(tmp_path, groups, *, text=True, name="sft.jsonl", **select):
    output = OutputConfig(path=str(tmp_path / name), layout="atropos", style="text" if text else "conversational",
                          tokenizer="letters" if text else None)
    config = SftExportConfig(select=SelectionConfig(**select), output=output)
    stats = export_sft(config, groups=groups, tokenizer=LetterTokenizer() if text else None)
    return stats, (tmp_path / name).read_text(encoding="utf-8")


def _dpo(tmp_path, groups, *, text=True, **select):
    output = OutputConfig(path=str(tmp_path / "dpo.jsonl"), layout="atropos", style="text" if text else "conversational",
                          tokenizer="letters" if text else None)
    config = DpoExportConfig(select=DpoSelectionConfig(**select), output=output)
    export_dpo(config, groups=groups, tokenizer=LetterTokenizer() if text else None)
    return [json.loads(line) for line in (tmp_path / "dpo.jsonl").read_text(encoding="utf-8").splitlines()]


def test_sft_text_lines_are_atropos_bytes(tmp_path):
    # Completions "cd", "ce", "f", "cd": the common prefix of the decoded texts is "ab" (the prompt) ...
    group = _group([0.5, 2.0, 1.0, 2.0], [(2, 3), (2, 4), (5,), (2, 3)])
    _, text = _sft(tmp_path, [group])
    # ... ranked best first with ties in group order, top 3, each line json.dumps(row, ensure_ascii=False).
    assert text == (
        '{"prefix": "ab", "completion": "ce", "score": 2.0}\n'
        '{"prefix": "ab", "completion": "cd", "score": 2.0}\n'
        '{"prefix": "ab", "completion": "f", "score": 1.0}\n'
    )


def test_the_prefix_is_common_text_not_the_prompt(tmp_path):
    # Every completion starts with "c": Atropos's prefix is the common text, so it takes the "c" too.
    _, text = _sft(tmp_path, [_group([1.0, 2.0], [(2, 3), (2, 4)])])
    assert [json.loads(line) for line in text.splitlines()] == [
        {"prefix": "abc", "completion": "e", "score": 2.0}, {"prefix": "abc", "completion": "d", "score": 1.0}]
    assert common_prefix(["abc", "abd", "ab"]) == "ab" and common_prefix(["x", "y"]) == "" and common_prefix([]) == ""


def test_sft_messages_lines_keep_unicode_and_filters(tmp_path):
    group = _group([0.0, -1.0, 0.7, 0.9], [(2,), (3,), (4,), (5,)])
    _, text = _sft(tmp_path, [group], text=False, min_score_diff_max_min=0.8)
    # Scores <= 0 go; 0.7 and 0.9 are more than 0.8 above the group's minimum (-1.0), so both stay.
    rows = [json.loads(line) for line in text.splitlines()]
    assert [(r["score"], r["messages"][1]["content"]) for r in rows] == [(0.9, "é3"), (0.7, "é2")]
    assert '"content": "é3"' in text and list(rows[0]) == ["messages", "score"]
    _, negatives = _sft(tmp_path, [group], text=False, name="neg.jsonl", allow_negative_scores=True)
    assert [json.loads(line)["score"] for line in negatives.splitlines()] == [0.9, 0.7, 0.0]


def test_top_n_is_picked_before_dedup_and_dedup_is_off_by_default(tmp_path):
    group = _group([3.0, 2.0, 1.0], [(2,), (2,), (3,)], prompt=(0,))  # the best two decode the same
    stats, text = _sft(tmp_path, [group], top_n_per_group=2)
    assert [json.loads(line)["score"] for line in text.splitlines()] == [3.0, 2.0]
    stats, text = _sft(tmp_path, [group], name="dedup.jsonl", top_n_per_group=2, dedup=True)
    # The duplicate among the top two is dropped, not replaced by the third best.
    assert [json.loads(line)["score"] for line in text.splitlines()] == [3.0]
    assert stats.dropped["duplicate"] == 1


def test_the_row_limit_is_exact(tmp_path):
    groups = [_group([1.0, 2.0, 3.0], [(2,), (3,), (4,)]) for _ in range(10)]
    stats, text = _sft(tmp_path, groups, limit=7)
    assert stats.rows_out == 7 and len(text.splitlines()) == 7 and stats.groups_in == 3


def test_dpo_lines_follow_atropos(tmp_path):
    # The pool is the 3 lowest (0.1, 1.0, 2.0); with a gap of 2.5 only 3.0 has a rejected, and only 0.1: one pair.
    group = _group([0.1, 3.0, 2.0, 1.0], [(2,), (3,), (4,), (5,)])
    rows = _dpo(tmp_path, [group], min_score_diff_max_min=2.5)
    assert rows == [{"prefix": "ab", "pos": "d", "score": 3.0, "neg": "c"}]
    rows = _dpo(tmp_path / "m", [group], text=False, min_score_diff_max_min=2.5)
    assert list(rows[0]) == ["pos", "score", "neg"] and rows[0]["pos"][1]["content"] == "é1"
    assert rows[0]["neg"][1]["content"] == "é0"


def test_dpo_pairs_use_each_rejected_once(tmp_path):
    group = _group([0.1, 3.0, 2.0, 1.0, 0.2], [(2,), (3,), (4,), (5,), (6,)])
    rows = _dpo(tmp_path, [group], pairs_per_group=3)
    assert len(rows) >= 2 and [r["pos"] for r in rows] == ["d", "e", "f"][: len(rows)]  # chosen best first
    negs = [r["neg"] for r in rows]  # drawn from the 3 lowest (0.1 "c", 0.2 "g", 1.0 "f"), each once
    assert len(set(negs)) == len(negs) and set(negs) <= {"c", "g", "f"}


def test_no_rows_is_an_error_when_asked_and_leaves_nothing(tmp_path):
    output = OutputConfig(path=str(tmp_path / "none.jsonl"), layout="atropos")
    with pytest.raises(NoRowsError, match="no rows matched: 1 groups"):
        export_sft(SftExportConfig(output=output), groups=[_group([0.0, -1.0], [(2,), (3,)])], require_rows=True)
    assert not list(tmp_path.iterdir())
