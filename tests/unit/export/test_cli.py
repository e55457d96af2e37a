"""`atropos-sft-gen` / `atropos-dpo-gen` accept Atropos's flags and read the shard store by default."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets

from factory.export.cli import _parser, build_export_config, main


def _config(kind, *argv):
    return build_export_config(kind, _parser(kind).parse_args(list(argv)))


def test_atropos_flags_map_onto_the_config():
    config = _config(
        "sft", "out.jsonl", "--save-top-n-per-group", "2", "--num-seqs-to-save", "50", "--allow-negative-scores",
        "--minimum-score-diff-max-min", "0.25", "--max-token-len", "512", "--save-messages", "--tokenizer", "tok",
        "--group-size", "8", "--append-to-previous",
    )
    assert config.select.top_n_per_group == 2 and config.select.limit == 50
    assert config.select.allow_negative_scores and config.select.min_score_diff_max_min == 0.25
    assert config.select.max_token_len == 512 and config.source.api_max_token_len == 512
    assert config.output.style == "conversational"  # --save-messages wins over --tokenizer
    assert config.output.append and config.output.resolved_format == "jsonl"
    assert config.source.api_group_size == 8 and config.source.api_url is None
    assert config.source.api_arrow and not _config("sft", "o.jsonl", "--api-json").source.api_arrow


def test_dpo_defaults_follow_atropos():
    config = _config("dpo", "pairs", "--api-url", "http://127.0.0.1:8000", "--tokenizer", "tok")
    assert config.select.min_score_diff_max_min == 0.5 and config.select.pairs_per_group == 3
    assert config.select.limit == 100  # Atropos's --num-seqs-to-save default when reading an API
    assert config.output.style == "text" and config.output.resolved_format == "parquet"


def test_cli_writes_from_the_store_and_refuses_to_overwrite(synthetic_store, tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    args = [str(out), "--store", str(synthetic_store.root), "--run", "run-b", "--save-top-n-per-group", "1", "--quiet"]
    assert main("sft", args) == 0
    assert "wrote" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30 and {r["run_id"] for r in rows} == {"run-b"}
    before = out.read_bytes()
    assert main("sft", args) == 1
    assert "--append-to-previous" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert main("sft", args + ["--append-to-previous", "--no-dedup"]) == 0
    assert len(out.read_text().splitlines()) == 60


def test_dpo_console_script_runs(synthetic_store, tmp_path):
    out = tmp_path / "dpo"
    result = subprocess.run(
        [sys.executable, "-c", "from factory.export.cli import dpo_main; dpo_main()", str(out), "--store",
         str(synthetic_store.root), "--num-seqs-to-save", "20", "--quiet", "--no-extra-columns"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert loaded.num_rows == 20 and loaded.column_names == ["prompt", "chosen", "rejected"]


def test_bad_store_gives_a_message_not_a_traceback(tmp_path, capsys):
    assert main("sft", [str(tmp_path / "o"), "--store", str(tmp_path / "empty")]) == 1
    assert "holds no runs" in capsys.readouterr().err
