"""Store -> selection -> rows: counts, filters, dedup and limits agree with the groups that went in."""

from __future__ import annotations

import datasets
import pytest

from factory.export import (
    DpoExportConfig,
    DpoSelectionConfig,
    OutputConfig,
    SelectionConfig,
    SftExportConfig,
    SourceConfig,
    export_dpo,
    export_sft,
)
from factory.export.select import DUPLICATE, NOT_POSITIVE, TOO_LONG, TOP_N
from factory.export.source import SourceError
from factory.store import ShardStore

from .conftest import scored


def _sft(store, path, **select):
    source = select.pop("source", {})
    config = SftExportConfig(source=SourceConfig(store=str(store.root), **source), select=SelectionConfig(**select),
                             output=OutputConfig(path=str(path)))
    return export_sft(config)


def _expected_sft_rows(store, runs, top_n=3, envs=None):
    total = 0
    for run in runs:
        for group in store.iter_groups(run):
            if envs and group.env not in envs:
                continue
            total += min(top_n, sum(1 for s in group.scores if s > 0))
    return total


def test_sft_export_of_all_runs_matches_atropos_selection(synthetic_store, tmp_path):
    stats = _sft(synthetic_store, tmp_path / "out")
    assert stats.groups_in == 110 and stats.rows_in == 880
    assert stats.rows_out == _expected_sft_rows(synthetic_store, ["run-a", "run-b"])
    assert stats.rows_in == stats.rows_out + sum(stats.dropped.values())
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    assert loaded.num_rows == stats.rows_out
    assert min(loaded["score"]) > 0
    assert set(loaded.column_names) == {"messages", "score", "group_id", "env", "run_id", "item_key"}
    per_group = {}
    for group_id in loaded["group_id"]:
        per_group[group_id] = per_group.get(group_id, 0) + 1
    assert max(per_group.values()) <= 3


def test_chosen_runs_and_envs(synthetic_store, tmp_path):
    stats = _sft(synthetic_store, tmp_path / "out", source={"runs": ["run-a"], "envs": ["code"]}, top_n_per_group=1)
    assert stats.groups_in == 40
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    assert set(loaded["env"]) == {"code"} and set(loaded["run_id"]) == {"run-a"}
    assert stats.rows_out == _expected_sft_rows(synthetic_store, ["run-a"], top_n=1, envs={"code"})


def test_unknown_run_is_named(synthetic_store, tmp_path):
    with pytest.raises(SourceError, match="run-zz"):
        _sft(synthetic_store, tmp_path / "out", source={"runs": ["run-zz"]})
    assert not (tmp_path / "out").exists()


def test_duplicates_across_runs_are_dropped(tmp_path):
    store = ShardStore(tmp_path / "store")
    groups = [scored([1.0, 0.5, 0.0], index=i) for i in range(5)]
    store.commit("run-1", "w", 0, groups)
    store.commit("run-2", "w", 0, [g.model_copy(update={"run_id": "run-2"}) for g in groups])
    stats = _sft(store, tmp_path / "out", dedup=True)
    assert stats.rows_out == 10 and stats.dropped[DUPLICATE] == 10
    assert _sft(store, tmp_path / "out2").rows_out == 20  # dedup only when asked for, as Atropos never does


def test_limit_is_exact_and_lengths_are_enforced(tmp_path):
    store = ShardStore(tmp_path / "store")
    store.commit("run-1", "w", 0, [scored([1.0, 1.0, 0.5], index=i, lengths=[6, 40, 6]) for i in range(50)])
    stats = _sft(store, tmp_path / "out", max_token_len=20)
    assert stats.rows_out == 100 and stats.dropped[TOO_LONG] == 50
    limited = _sft(store, tmp_path / "out2", limit=7)
    assert limited.rows_out == 7
    assert datasets.load_dataset("parquet", data_dir=str(tmp_path / "out2"), split="train").num_rows == 7


def test_top_n_is_picked_before_duplicates_are_dropped(tmp_path):
    group = scored([1.0, 0.9, 0.8])
    group.messages[1] = group.messages[0]  # the second best says the same as the best
    stats = export_sft(
        SftExportConfig(select=SelectionConfig(top_n_per_group=2, dedup=True),
                        output=OutputConfig(path=str(tmp_path / "o.jsonl"))),
        groups=[_wire(group)],
    )
    assert stats.rows_out == 1 and stats.dropped == {DUPLICATE: 1, TOP_N: 1}  # the third best does not move up


def _wire(group):
    from factory.export.source import group_from_wire

    return group_from_wire(group.model_dump())


def test_dpo_export_pairs_within_groups(synthetic_store, tmp_path):
    config = DpoExportConfig(source=SourceConfig(store=str(synthetic_store.root)),
                             select=DpoSelectionConfig(pairs_per_group=2), output=OutputConfig(path=str(tmp_path / "dpo")))
    stats = export_dpo(config)
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "dpo"), split="train")
    assert loaded.num_rows == stats.rows_out > 0
    for row in loaded:
        assert row["score_chosen"] - row["score_rejected"] > 0.5
        assert row["prompt"][-1]["role"] == "user" and row["chosen"][0]["role"] == "assistant"
    assert stats.rows_in == 880


def test_dpo_text_export_with_a_tokenizer(tmp_path, tiny_tokenizer_dir):
    output = OutputConfig(path=str(tmp_path / "dpo.jsonl"), style="text", tokenizer=str(tiny_tokenizer_dir))
    stats = export_dpo(DpoExportConfig(output=output), groups=[_wire(scored([1.0, 0.0], index=i)) for i in range(3)])
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "dpo.jsonl"), split="train")
    assert stats.rows_out == 3
    assert loaded[0]["prompt"] == "<|user|>q0<|end|><|assistant|>" and loaded[0]["chosen"] == "a0-0<|end|>"


def test_a_failure_mid_export_publishes_nothing(tmp_path):
    def groups():
        yield _wire(scored([1.0, 0.0]))
        raise RuntimeError("store went away")

    with pytest.raises(RuntimeError):
        export_sft(SftExportConfig(output=OutputConfig(path=str(tmp_path / "out"))), groups=groups())
    assert list(tmp_path.iterdir()) == []


def test_stats_account_for_every_sequence(synthetic_store, tmp_path):
    stats = _sft(synthetic_store, tmp_path / "out", top_n_per_group=1)
    assert stats.rows_in == stats.rows_out + sum(stats.dropped.values())
    assert stats.dropped[NOT_POSITIVE] > 0 and stats.dropped[TOP_N] > 0
    assert sum(n for *_, n in stats.scores_in.bins()) == stats.rows_in
    assert sum(n for *_, n in stats.scores_out.bins()) == stats.rows_out
    text = stats.markdown()
    assert "| not_positive_score |" in text and "Score histogram" in text


def test_groups_without_messages_export_as_decoded_text_from_the_store(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    store = ShardStore(tmp_path / "store")
    store.commit("run-1", "w", 0, [scored([1.0, 0.0], index=i, messages=False) for i in range(4)])
    output = OutputConfig(path=str(tmp_path / "sft.jsonl"), style="text", tokenizer=str(tiny_tokenizer_dir),
                          prompt_completion=True)
    # Every group decodes to the same text here, so dedup is off to see all four.
    stats = export_sft(SftExportConfig(source=SourceConfig(store=str(store.root)), select=SelectionConfig(dedup=False),
                                       output=output))
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    rows = datasets.load_dataset("json", data_files=output.path, split="train")
    assert stats.rows_out == 4 and stats.groups_in == 4
    assert rows[0]["prompt"] == tokenizer.decode([1, 2]) and rows[0]["completion"] == tokenizer.decode([10] * 4)
    conversational = export_sft(SftExportConfig(source=SourceConfig(store=str(store.root)),
                                                output=OutputConfig(path=str(tmp_path / "c.jsonl"))))
    assert conversational.rows_out == 0 and conversational.dropped["unrenderable"] == 4
