"""Every entry point answers --help (exit 0) with the options, defaults and descriptions of the model that parses it.

Console scripts are read from pyproject.toml and called as their wrappers call them; `python -m` modules and the
env scripts run through runpy as `__main__`, so the code path is the one a user's command takes.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from factory.config import _section_model, config_help

ROOT = Path(__file__).resolve().parents[3]
CONSOLE_SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# Env scripts: the files that run an environment's CLI (process / evaluate / serve), not the scaffold or `-m environments`.
ENV_SCRIPTS = sorted(p.name for p in (ROOT / "environments").glob("*.py")
                     if 'if __name__ == "__main__"' in p.read_text() and "from flows.datagen import cli" in p.read_text()
                     and p.name not in ("scaffold.py", "__main__.py"))
MODULES = ["flows.train", "flows.serve", "flows.export", "flows.rl_loop", "flows.inference", "factory.train.loop",
           "factory.progress", "factory.slurm_cluster", "factory.viewer", "flows.grpo_train", "flows.atropos_env",
           "environments"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def leaf_descriptions(model: type[BaseModel]) -> list[str]:
    found = []
    for field in model.model_fields.values():
        section = _section_model(field.annotation)
        if section is not None:
            found += leaf_descriptions(section)
        elif field.description:
            found.append(field.description)
    return found


def run_help(call, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys, "argv", argv)
    try:
        code = call()
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    assert code in (0, None), f"{argv} exited {code}: {err[-2000:]}"
    assert "Traceback" not in out + err
    return _flat(out)


def assert_documents(model: type[BaseModel], text: str) -> None:
    missing = [d for d in leaf_descriptions(model) if _flat(d) not in text]
    assert not missing, f"descriptions missing from --help: {missing[:3]}"
    assert "PydanticUndefined" not in text


@pytest.mark.parametrize("name", sorted(CONSOLE_SCRIPTS))
def test_console_scripts_answer_help(name: str, capsys, monkeypatch) -> None:
    module, func = CONSOLE_SCRIPTS[name].split(":")
    text = run_help(getattr(importlib.import_module(module), func), [name, "--help"], capsys, monkeypatch)
    assert "usage:" in text and "--" in text
    if name == "run-api":
        from factory.serve.config import ServeConfig

        assert_documents(ServeConfig, text)
        assert "--port (int, default 8000) TCP port" in text


@pytest.mark.parametrize("module", MODULES)
def test_modules_answer_help(module: str, capsys, monkeypatch) -> None:
    text = run_help(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), [module, "--help"],
                    capsys, monkeypatch)
    assert "usage:" in text
    models = {"flows.train": "factory.train.config:TrainJobConfig", "factory.train.loop": "factory.train.config:TrainJobConfig",
              "flows.serve": "factory.serve.config:ServeConfig", "flows.rl_loop": "flows.rl_loop:RLLoopConfig"}
    if module in models:
        mod, cls = models[module].split(":")
        assert_documents(getattr(importlib.import_module(mod), cls), text)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_export_flow_answers_help(kind: str, capsys, monkeypatch) -> None:
    from factory.export.config import DpoExportConfig, SftExportConfig

    text = run_help(lambda: runpy.run_module("flows.export", run_name="__main__", alter_sys=True),
                    ["flows.export", kind, "--help"], capsys, monkeypatch)
    assert_documents(SftExportConfig if kind == "sft" else DpoExportConfig, text)


@pytest.mark.parametrize("script", ENV_SCRIPTS)
def test_env_scripts_answer_help(script: str, capsys, monkeypatch) -> None:
    from flows.datagen import job_config_model

    path = str(ROOT / "environments" / script)
    text = run_help(lambda: runpy.run_path(path, run_name="__main__"), [path, "process", "--help"], capsys, monkeypatch)
    assert "process" in text and "--env.group_size" in text and "--openai.base_url" in text
    ref = next(line.split('cli("')[1].split('"')[0] for line in Path(path).read_text().splitlines() if 'cli("' in line)
    assert_documents(job_config_model(ref), text)
    text = run_help(lambda: runpy.run_path(path, run_name="__main__"), [path, "--help"], capsys, monkeypatch)
    assert "process" in text and "evaluate" in text


def test_help_shows_defaults_and_required_keys() -> None:
    from factory.export.config import SftExportConfig

    text = _flat(config_help(SftExportConfig, prog="x"))
    assert "--output.path (str, required)" in text
    assert "--source.store (str, default './data')" in text
