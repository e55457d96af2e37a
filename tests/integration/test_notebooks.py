"""The notebooks run top to bottom against a small store made here (nbclient), and are stored without outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["inspect_run.ipynb", "preview_export.ipynb"]


def _make_demo_store():
    spec = importlib.util.spec_from_file_location("make_demo_store", NOTEBOOKS / "make_demo_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_demo_store


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: strip outputs before committing"


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_against_a_demo_store(name, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    from tests.unit.export.conftest import build_tiny_tokenizer

    _make_demo_store()(tmp_path / "store", "demo", groups=60)
    monkeypatch.setenv("FACTORY_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("FACTORY_RUN", "demo")
    monkeypatch.setenv("FACTORY_EXPORT_DIR", str(tmp_path / "exports"))
    monkeypatch.setenv("FACTORY_TOKENIZER", str(build_tiny_tokenizer(tmp_path / "tokenizer")))
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = "\n".join(
        output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "Traceback" not in text
    if name == "inspect_run.ipynb":
        assert "60 groups, 240 sequences" in text and "arithmetic" in text
    else:
        assert (tmp_path / "exports" / "sft").is_dir() and (tmp_path / "exports" / "dpo.jsonl").is_file()
        assert "<|user|>" in text  # the chat-template cell ran with the tokenizer
