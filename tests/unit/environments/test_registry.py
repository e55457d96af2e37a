"""Environments by name: built-ins, entry-point plugins (a broken one is listed with its error), the scaffold,
and every deployment in prefect.yaml pointing at a real flow, config and environment."""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

from environments import registry
from environments.base import EnvSpec
from environments.registry import BUILTIN, ENTRY_POINT_GROUP, discover, resolve
from environments.scaffold import ScaffoldError, new_env

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def fake_plugins(monkeypatch, tmp_path):
    """Three entry points: one that loads, one whose import fails, one that takes a built-in's name."""
    (tmp_path / "good_plugin.py").write_text(
        "from environments.shape_count import ShapeCountEnv\n\nclass Good(ShapeCountEnv):\n    name = 'good'\n")
    (tmp_path / "broken_plugin.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [EntryPoint("good", "good_plugin:Good", ENTRY_POINT_GROUP),
              EntryPoint("broken", "broken_plugin:Env", ENTRY_POINT_GROUP),
              EntryPoint("chess", "good_plugin:Good", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: points if group == ENTRY_POINT_GROUP else [])
    return points


def test_builtins_all_load():
    entries = discover()
    assert [e.name for e in entries] == list(BUILTIN)
    assert all(e.error is None for e in entries), [e for e in entries if e.error]


def test_plugins_are_listed_and_a_broken_one_does_not_stop_the_others(fake_plugins):
    by_name = {(e.name, e.source): e for e in discover()}
    assert by_name[("good", "plugin:?")].error is None
    broken = by_name[("broken", "plugin:?")]
    assert broken.error.startswith("ModuleNotFoundError") and "a_dependency_that_is_not_installed" in broken.error
    assert "already taken" in by_name[("chess", "plugin:?")].error
    assert by_name[("chess", "builtin")].error is None and resolve("chess") == BUILTIN["chess"]
    assert resolve("good") == "good_plugin:Good"
    env = EnvSpec(resolve("good"), {"group_size": 2}).build()
    assert env.name == "good" and env.score(env.get_item(0), f"<answer>{env.get_item(0).answer}</answer>") == 1.0


def test_unknown_name_lists_what_is_known(fake_plugins):
    with pytest.raises(ValueError, match="unknown environment 'nope'.*good.*install a plugin"):
        resolve("nope")
    assert resolve("pkg.mod:Cls") == "pkg.mod:Cls"


def test_list_command_prints_errors_and_keeps_going(fake_plugins, capsys):
    from environments.__main__ import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "good" in out and "error: ModuleNotFoundError" in out and "chess" in out


def test_scaffold_writes_a_working_env_config_test_and_deployment(tmp_path, monkeypatch):
    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text((REPO / "prefect.yaml").read_text())
    written = new_env("word_sum", tmp_path / "plugins" / "word_sum", prefect_yaml)
    root = tmp_path / "plugins" / "word_sum"
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "plugins/word_sum/pyproject.toml", "plugins/word_sum/word_sum_env/__init__.py",
        "plugins/word_sum/word_sum.yaml", "plugins/word_sum/tests/test_word_sum.py", "prefect.yaml"}
    monkeypatch.syspath_prepend(str(root))
    module = importlib.import_module("word_sum_env")
    env = module.WordSumEnv()
    item = env.get_item(3)
    assert env.score(item, f"<answer>{item.answer}</answer>") == 1.0 and env.score(item, "?") == 0.0
    deployment = next(d for d in yaml.safe_load(prefect_yaml.read_text())["deployments"]
                      if d["name"] == "word_sum-datagen")
    assert deployment["entrypoint"] == "flows.env_library:env_datagen"
    assert deployment["parameters"] == {"env_name": "word_sum", "config_path": "plugins/word_sum/word_sum.yaml"}
    config = yaml.safe_load((root / "word_sum.yaml").read_text())
    assert set(config) == {"env", "openai", "datagen"} and config["datagen"]["run_id"] == "word_sum"
    assert 'word_sum = "word_sum_env:WordSumEnv"' in (root / "pyproject.toml").read_text()
    with pytest.raises(ScaffoldError, match="not empty"):
        new_env("word_sum", root, prefect_yaml)
    with pytest.raises(ScaffoldError, match="already has a deployment"):
        new_env("word_sum", tmp_path / "again", prefect_yaml)
    sys.modules.pop("word_sum_env", None)


@pytest.mark.parametrize("name, match", [("Bad-Name", "lower case"), ("chess", "built-in")])
def test_scaffold_refuses_bad_names(tmp_path, name, match):
    with pytest.raises(ScaffoldError, match=match):
        new_env(name, tmp_path / "x", None)


def test_every_deployment_points_at_a_flow_a_config_and_an_environment():
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    names = [d["name"] for d in deployments]
    assert len(names) == len(set(names))
    for deployment in deployments:
        path, _, function = deployment["entrypoint"].partition(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, function)
        inspect.signature(flow.fn).bind(**deployment.get("parameters", {}))
        config = deployment.get("parameters", {}).get("config_path")
        assert config is None or (REPO / config).exists(), deployment["name"]
    from flows.env_library import LIBRARY

    flows = {d["entrypoint"].partition(":")[2] for d in deployments}
    for name in LIBRARY:
        assert f"{name}_datagen" in flows, f"{name} has no deployment in prefect.yaml"
