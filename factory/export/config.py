"""Config of the SFT and DPO exports: where groups come from, which rows are kept, how they are written.

The same models back the Prefect flows (`sft-export`, `dpo-export`), the
`atropos-sft-gen` / `atropos-dpo-gen` CLIs and the plain functions, so a YAML
file and dotted overrides (`--select.top_n_per_group 2`) work everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from factory.config import FactoryConfig

OutputFormat = Literal["parquet", "jsonl"]
SINGLE_FILE_SUFFIXES: dict[str, OutputFormat] = {".parquet": "parquet", ".jsonl": "jsonl"}


class SourceConfig(FactoryConfig):
    """Where the groups come from: the shard store (default) or a running Atropos-compatible batching API."""

    store: str = Field("./data", description="Shard store: a root directory, or an object store URL (s3://bucket/prefix).")
    runs: list[str] = Field(default_factory=list, description="Runs to read, in order; empty reads every run in the store.")
    envs: list[str] = Field(default_factory=list, description="Environments to keep; empty keeps all.")
    batch_groups: int = Field(1024, ge=1, description="Groups read per Arrow batch (bounds memory).")
    api_url: str | None = Field(None, description="Read from this batching API (POST /register, GET /batch) instead of the store.")
    api_group_size: int = Field(2, ge=1, description="Group size sent on /register (batch_size = group_size * tasks_per_step).")
    api_tasks_per_step: int = Field(64, ge=1, description="Groups per trainer step sent on /register.")
    api_max_token_len: int = Field(2048, ge=1, description="max_token_len sent on /register.")
    api_idle_timeout_s: float | None = Field(
        60.0, gt=0, description="Stop reading the API after this long without a batch; None polls until the row limit "
        "is reached, as Atropos's CLIs do."
    )
    api_poll_s: float = Field(1.0, gt=0, description="Wait between /batch polls while the API has no batch.")
    api_reset_first: bool = Field(False, description="Call GET /reset_data before /register, as Atropos's CLIs do (drops queued data).")
    api_num_steps: int = Field(1_000_000, ge=0, description="num_steps sent on /register (Atropos's sft-gen sends 0, "
                               "its dpo-gen 2 x --num-seqs-to-save).")
    api_print_responses: bool = Field(False, description="Print the /reset_data and /register answers to stdout, as "
                                      "Atropos's CLIs do.")
    api_arrow: bool = Field(
        True, description="Ask the API for /batch as an Arrow stream (a factory run-api sends one: less CPU on both ends, "
        "stored group ids and env names); an API that answers JSON, as Atropos's does, is read as JSON. False asks for JSON.",
    )


class SelectionConfig(FactoryConfig):
    """Which sequences of a group are kept (SFT) or may take part in pairs (DPO)."""

    min_score: float | None = Field(None, description="Keep only sequences scoring at least this; None sets no floor.")
    allow_negative_scores: bool = Field(False, description="Also keep sequences scoring <= 0 (Atropos keeps only score > 0).")
    min_score_diff_max_min: float = Field(
        0.0, ge=0, description="Keep a sequence only if its score exceeds the group's minimum by more than this (0: off)."
    )
    top_n_per_group: int = Field(3, ge=1, description="Most sequences kept per group, best first.")
    max_token_len: int | None = Field(None, ge=1, description="Drop sequences with more tokens than this (prompt + completion).")
    min_completion_tokens: int = Field(0, ge=0, description="Drop sequences whose completion has fewer tokens than this.")
    dedup: bool = Field(
        False, description="Drop rows whose rendered content was already written in this export (after the top-n pick; "
        "Atropos never deduplicates)."
    )
    limit: int | None = Field(None, ge=1, description="Stop after this many output rows (Atropos's --num-seqs-to-save).")


class DpoSelectionConfig(SelectionConfig):
    """Pairing rules for DPO, following Atropos's dpo-gen: best chosen first, each rejected used once."""

    min_score_diff_max_min: float = Field(
        0.5, ge=0, description="A rejected must score more than this below its chosen."
    )
    pairs_per_group: int = Field(3, ge=1, description="Most pairs per group; also the size of the rejected pool (lowest scores).")
    seed: int = Field(0, description="Seed of the random pick among eligible rejected (per group, reproducible).")


class OutputConfig(FactoryConfig):
    """How and where rows are written."""

    path: str = Field(description="A directory of shards, or one file when it ends in .parquet or .jsonl.")
    format: OutputFormat | None = Field(None, description="parquet or jsonl; default: from the path's suffix, else parquet.")
    style: Literal["conversational", "text"] = Field(
        "conversational", description="Message lists, or strings rendered with the tokenizer's chat template."
    )
    prompt_completion: bool = Field(False, description="SFT: write prompt/completion columns instead of messages.")
    tokenizer: str | None = Field(None, description="Tokenizer dir or hub id for text rendering (needed by style=text).")
    extra_columns: bool = Field(True, description="Also write score(s), group_id, env, run_id and item_key.")
    layout: Literal["trl", "atropos"] = Field(
        "trl", description="trl: TRL-ready columns (Parquet or JSONL). atropos: the lines atroposlib's sft/dpo-gen "
        "write ({prefix, completion, score} / {messages, score}; DPO {prefix, pos, score, neg}), one JSON lines file.",
    )
    overwrite: bool = Field(False, description="Replace an existing output.")
    append: bool = Field(False, description="Add to an existing output (Atropos's --append-to-previous).")
    rows_per_shard: int = Field(200_000, ge=1, description="Rows per shard when the output is a directory.")
    images: bool = Field(
        False,
        description="Keep multimodal sequences in TRL's vision layout: content parts with image placeholders and an "
        "`images` column of the pictures' bytes (Parquet, conversational). Off: they are left out, counted.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> OutputConfig:
        if self.overwrite and self.append:
            raise ValueError("output.overwrite and output.append exclude each other: pick one")
        if self.style == "text" and not self.tokenizer:
            raise ValueError("output.style 'text' needs output.tokenizer (a tokenizer dir or hub id with a chat template)")
        if self.images and self.style == "text":
            raise ValueError("output.images writes message lists with image placeholders; it needs output.style "
                             "'conversational' (drop --tokenizer or add --save-messages)")
        if self.images and self.resolved_format != "parquet":
            raise ValueError("output.images writes the pictures' bytes, which only Parquet holds: write a .parquet "
                             "file or a directory of Parquet shards")
        if self.layout == "atropos" and (self.images or self.prompt_completion):
            raise ValueError("output.layout 'atropos' writes Atropos's own lines; --keep-images and --prompt-completion "
                             "are TRL layouts: add --layout trl")
        suffix_format = SINGLE_FILE_SUFFIXES.get(Path(self.path).suffix)
        if suffix_format and self.format and self.format != suffix_format:
            raise ValueError(f"output.path {self.path!r} ends in {Path(self.path).suffix} but output.format is {self.format!r}")
        return self

    @property
    def resolved_format(self) -> OutputFormat:
        if self.layout == "atropos":
            return "jsonl"
        return SINGLE_FILE_SUFFIXES.get(Path(self.path).suffix) or self.format or "parquet"

    @property
    def single_file(self) -> bool:
        return self.layout == "atropos" or Path(self.path).suffix in SINGLE_FILE_SUFFIXES


class SftExportConfig(FactoryConfig):
    """An SFT export: rows of the best sequences per group."""

    source: SourceConfig = Field(default_factory=SourceConfig, description="Where groups come from.")
    select: SelectionConfig = Field(default_factory=SelectionConfig, description="Which sequences are kept.")
    output: OutputConfig = Field(description="Where and how rows are written.")


class DpoExportConfig(FactoryConfig):
    """A DPO export: chosen/rejected pairs within each group."""

    source: SourceConfig = Field(default_factory=SourceConfig, description="Where groups come from.")
    select: DpoSelectionConfig = Field(default_factory=DpoSelectionConfig, description="Which pairs are made.")
    output: OutputConfig = Field(description="Where and how pairs are written.")

    @model_validator(mode="after")
    def _no_prompt_completion(self) -> DpoExportConfig:
        if self.output.prompt_completion:
            raise ValueError("output.prompt_completion is an SFT option; DPO always writes prompt/chosen/rejected")
        return self
