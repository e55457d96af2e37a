"""SFT and DPO export: select, pair and render scored groups into TRL-ready datasets (Parquet or JSONL).

Names are imported on first use (PEP 562), so `atropos-sft-gen` pays only for the modules it runs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.export.config import (
        DpoExportConfig,
        DpoSelectionConfig,
        OutputConfig,
        SelectionConfig,
        SftExportConfig,
        SourceConfig,
    )
    from factory.export.pipeline import export_dpo, export_sft
    from factory.export.stats import ExportStats
    from factory.export.writer import OutputExistsError

_WHERE = {
    "DpoExportConfig": "config",
    "DpoSelectionConfig": "config",
    "OutputConfig": "config",
    "SelectionConfig": "config",
    "SftExportConfig": "config",
    "SourceConfig": "config",
    "export_dpo": "pipeline",
    "export_sft": "pipeline",
    "ExportStats": "stats",
    "OutputExistsError": "writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'factory.export' has no attribute {name!r}")
    return getattr(import_module(f"factory.export.{_WHERE[name]}"), name)
