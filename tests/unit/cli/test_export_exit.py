"""An export that matches nothing exits non-zero (a script can tell it from a written dataset)."""

from __future__ import annotations

from pathlib import Path

from factory.export.cli import main
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def test_export_matching_nothing_exits_1_and_says_why(tmp_path: Path, capsys) -> None:
    ShardStore(tmp_path / "store").commit("run-1", "p", 0, synthetic_groups(6, group_size=4, seq_len=8, vocab=50, seed=1))
    tokenizer = str(Path(__file__).resolve().parents[3] / "models" / "starter-policy")
    args = ["--store", str(tmp_path / "store"), "--tokenizer", tokenizer, "--quiet"]
    assert main("sft", [str(tmp_path / "all.jsonl"), *args]) == 0
    capsys.readouterr()
    assert main("sft", [str(tmp_path / "none.jsonl"), *args, "--min-score", "1000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("atropos-sft-gen: no rows matched: 6 groups") and "--min-score" in err
