"""`atropos-sft-gen` / `atropos-dpo-gen`: atroposlib 0.4.0's flags and defaults; the store and TRL rows on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import datasets

from factory.export.cli import _parser, build_export_config, main
from tests.conftest import free_port

# atroposlib 0.4.0's argparse defaults (atroposlib/cli/sft.py and dpo.py), written out so that a change shows.
ATROPOS_SFT_DEFAULTS = {
    "api_url": "http://localhost:8000", "group_size": 2, "max_token_len": 2048,
    "tokenizer": "NousResearch/DeepHermes-3-Llama-3-8B-Preview", "save_messages": False, "save_top_n_per_group": 3,
    "allow_negative_scores": False, "minimum_score_diff_max_min": 0.0, "append_to_previous": False,
    "tasks_per_step": 64,
}
ATROPOS_DPO_DEFAULTS = {
    **{k: v for k, v in ATROPOS_SFT_DEFAULTS.items() if k not in ("save_top_n_per_group", "tasks_per_step")},
    "save_n_pairs_per_group": 3, "minimum_score_diff_max_min": 0.5,
}


def _config(kind, *argv):
    return build_export_config(kind, _parser(kind).parse_args(list(argv)))


def test_every_atropos_flag_has_atropos_default():
    for kind, defaults in (("sft", ATROPOS_SFT_DEFAULTS), ("dpo", ATROPOS_DPO_DEFAULTS)):
        args = vars(_parser(kind).parse_args(["out.jsonl"]))
        assert {k: args[k] for k in defaults} == defaults
        config = _config(kind, "out.jsonl")
        assert config.select.limit == 100 and not config.select.dedup  # --num-seqs-to-save 100; no dedup
        assert config.source.api_url == "http://localhost:8000" and config.source.api_reset_first
        assert config.source.api_idle_timeout_s is None  # polls until the rows are written
        assert config.output.layout == "atropos" and config.output.style == "text"
        assert config.select.max_token_len is None  # --max-token-len only goes to /register
    assert _config("sft", "o").source.api_num_steps == 0 and _config("sft", "o").source.api_tasks_per_step == 64
    dpo = _config("dpo", "o", "--num-seqs-to-save", "30")
    assert dpo.source.api_num_steps == 60 and dpo.source.api_tasks_per_step == 8  # as Atropos's dpo-gen registers


def test_atropos_flags_map_onto_the_config():
    config = _config(
        "sft", "out.jsonl", "--save-top-n-per-group", "2", "--num-seqs-to-save", "50", "--allow-negative-scores",
        "--minimum-score-diff-max-min", "0.25", "--max-token-len", "512", "--save-messages", "--tokenizer", "tok",
        "--group-size", "8", "--append-to-previous",
    )
    assert config.select.top_n_per_group == 2 and config.select.limit == 50
    assert config.select.allow_negative_scores and config.select.min_score_diff_max_min == 0.25
    assert config.source.api_max_token_len == 512 and config.select.max_token_len is None
    assert config.output.style == "conversational" and config.output.tokenizer is None  # no tokenizer is loaded
    assert config.output.append and config.output.resolved_format == "jsonl"
    assert config.source.api_group_size == 8
    assert config.source.api_arrow and not _config("sft", "o.jsonl", "--api-json").source.api_arrow
    store = _config("sft", "o", "--run", "run-1", "--dedup", "--layout", "trl", "--max-token-len-filter", "99")
    assert store.source.api_url is None and store.select.limit is None and store.select.dedup
    assert store.output.style == "conversational"  # Atropos's default tokenizer is not taken as asking for text
    assert store.select.max_token_len == 99


def test_cli_writes_atropos_lines_from_the_store_and_refuses_to_overwrite(synthetic_store, tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    args = [str(out), "--store", str(synthetic_store.root), "--run", "run-b", "--save-top-n-per-group", "1",
            "--save-messages", "--quiet"]
    assert main("sft", args) == 0
    assert "wrote 30 rows" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30 and all(list(r) == ["messages", "score"] and r["score"] > 0 for r in rows)
    before = out.read_bytes()
    assert main("sft", args) == 1
    assert "--append-to-previous" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert main("sft", args + ["--append-to-previous"]) == 0
    assert len(out.read_text().splitlines()) == 60


def test_dpo_console_script_writes_trl_rows_on_request(synthetic_store, tmp_path):
    out = tmp_path / "dpo"
    result = subprocess.run(
        [sys.executable, "-c", "from factory.export.cli import dpo_main; dpo_main()", str(out), "--store",
         str(synthetic_store.root), "--num-seqs-to-save", "20", "--quiet", "--layout", "trl", "--no-extra-columns"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert loaded.num_rows == 20 and loaded.column_names == ["prompt", "chosen", "rejected"]


def test_bad_store_gives_a_message_not_a_traceback(tmp_path, capsys):
    assert main("sft", [str(tmp_path / "o"), "--store", str(tmp_path / "empty"), "--save-messages"]) == 1
    assert "holds no runs" in capsys.readouterr().err


def test_an_export_matching_no_rows_says_so(synthetic_store, tmp_path, capsys):
    out = tmp_path / "none.jsonl"
    assert main("sft", [str(out), "--run", "run-b", "--store", str(synthetic_store.root), "--save-messages",
                        "--min-score", "1000", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("atropos-sft-gen: no rows matched: 30 groups") and "below_min_score" in err
    assert len(err.splitlines()) == 1 and not out.exists()


def _cli(kind, *argv, timeout=60):
    started = time.monotonic()
    command = [sys.executable, "-c", f"from factory.export.cli import {kind}_main; {kind}_main()", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return result, time.monotonic() - started


def test_bad_api_url_or_tokenizer_exit_in_seconds_with_one_line(synthetic_store, tmp_path):
    refused, seconds = _cli("sft", str(tmp_path / "a.jsonl"), "--api-url", f"http://127.0.0.1:{free_port()}",
                            "--save-messages")
    assert refused.returncode == 1 and seconds < 15
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert "cannot reach the batching API" in refused.stderr
    no_scheme, _ = _cli("dpo", str(tmp_path / "b.jsonl"), "--api-url", "localhost:1", "--save-messages")
    assert no_scheme.returncode == 1 and len(no_scheme.stderr.strip().splitlines()) == 1, no_scheme.stderr
    no_tokenizer, seconds = _cli("sft", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "missing"), "--store",
                                 str(synthetic_store.root))
    assert no_tokenizer.returncode == 1 and seconds < 15
    assert no_tokenizer.stderr.strip().startswith("atropos-sft-gen: cannot load tokenizer")
    assert len(no_tokenizer.stderr.strip().splitlines()) == 1, no_tokenizer.stderr
    assert not list(tmp_path.glob("*.jsonl")) and not list(tmp_path.glob(".*"))
