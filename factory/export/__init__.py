"""SFT and DPO export: select, pair and render scored groups into TRL-ready datasets (Parquet or JSONL)."""

from factory.export.config import DpoExportConfig, DpoSelectionConfig, OutputConfig, SelectionConfig, SftExportConfig, SourceConfig
from factory.export.pipeline import export_dpo, export_sft
from factory.export.stats import ExportStats
from factory.export.writer import OutputExistsError

__all__ = [
    "DpoExportConfig",
    "DpoSelectionConfig",
    "ExportStats",
    "OutputConfig",
    "OutputExistsError",
    "SelectionConfig",
    "SftExportConfig",
    "SourceConfig",
    "export_dpo",
    "export_sft",
]
