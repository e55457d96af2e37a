"""`python -m environments new NAME`: a working environment as its own installable plugin package.

It writes, under `--path` (default `./plugins/NAME`):

    pyproject.toml          the package, with its `rollout_factory.environments` entry point
    NAME_env/__init__.py    the environment: items, config, scoring (a small verifiable task to edit)
    NAME.yaml               its job config (env / openai / datagen sections, like deployments/*.yaml)
    tests/test_NAME.py      tests of its items and scoring (`pytest` in the package dir)

and appends a `NAME-datagen` deployment to `prefect.yaml` (the `env-datagen` flow with `env_name: NAME`).
`pip install -e plugins/NAME` registers it; from then on it is listed, run, deployed and served by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from environments.registry import BUILTIN

_NAME = re.compile(r"^[a-z][a-z0-9_]{1,40}$")

ENV_PY = '''"""{title}: a generated environment; replace the items and the scoring with your task.

The skeleton asks for the sum of two seeded numbers and rewards the right one in <answer></answer>.
"""

from __future__ import annotations

import random
import re

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item

_ANSWER = re.compile(r"<answer>\\s*(-?\\d+)\\s*</answer>")


class {cls}Config(EnvConfig):
    """The `env.` section for {name}."""

    max_value: int = Field(99, ge=1, description="Largest number in a question.")
    system_prompt: str | None = Field("Put the final answer in <answer></answer>.",
                                      description="System message put before every question.")
    max_tokens: int = Field(32, ge=1, description="Most new tokens per completion.")


class {cls}Env(BaseEnv):
    name = "{name}"
    config_cls = {cls}Config
    scoring = "inline"  # one regex: cheap and bounded
    config: {cls}Config

    def get_item(self, index: int) -> Item:
        rng = random.Random(f"{{self.config.seed}}:{{index}}")
        a, b = rng.randint(0, self.config.max_value), rng.randint(0, self.config.max_value)
        return Item(key=f"{name}:{{self.config.seed}}:{{index}}", messages=self.chat(f"What is {{a}} + {{b}}?"),
                    answer=a + b)

    def score(self, item: Item, completion: str) -> float:
        found = _ANSWER.findall(completion)
        return 1.0 if found and int(found[-1]) == item.answer else 0.0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("{module}:{cls}Env"))
'''

PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "The {name} environment for rollout-factory."
requires-python = ">=3.11"
dependencies = []  # rollout-factory itself is the host; add what your environment needs

[project.entry-points."rollout_factory.environments"]
{name} = "{module}:{cls}Env"

[tool.setuptools]
packages = ["{module}"]
'''

CONFIG_YAML = '''# {name}: a generated environment (plugin package {dist}), on the local starter policy.
env:
  group_size: 8
  total_items: 200
  max_tokens: 32
  max_token_length: 512
  tokenizer_name: models/starter-policy
openai:
  base_url: http://127.0.0.1:30000
  model_name: starter-policy
  server_type: sglang
datagen:
  run_id: {name}
  store_root: ./data
  chunk_items: 50
'''

TEST_PY = '''"""{name}: items are fixed by seed and index; the right answer scores 1, a wrong or missing one 0."""

from environments.registry import resolve
from {module} import {cls}Config, {cls}Env


def test_items_are_deterministic():
    env = {cls}Env({cls}Config(seed=1))
    assert [env.get_item(i) for i in range(5)] == [{cls}Env({cls}Config(seed=1)).get_item(i) for i in range(5)]


def test_scoring():
    env = {cls}Env()
    item = env.get_item(0)
    assert env.score(item, f"<answer>{{item.answer}}</answer>") == 1.0
    assert env.score(item, f"<answer>{{item.answer + 1}}</answer>") == 0.0
    assert env.score(item, "no answer") == 0.0


def test_registered_by_its_entry_point():
    assert resolve("{name}") == "{module}:{cls}Env"
'''

DEPLOYMENT = '''
- name: {name}-datagen
  entrypoint: flows.env_library:env_datagen
  description: "{name} (plugin package {dist}; pip install -e {path})."
  tags: [datagen, plugin, {name}]
  parameters:
    env_name: {name}
    config_path: {config}
  work_pool:
    name: local-process
    job_variables:
      env: {{OMP_NUM_THREADS: "1", HF_HUB_OFFLINE: "1"}}
'''


class ScaffoldError(ValueError):
    """The scaffold cannot be written as asked; the message names the value and the fix."""


def new_env(name: str, path: str | Path | None = None, prefect_yaml: str | Path | None = "prefect.yaml") -> list[Path]:
    """Write the plugin package for `name` (see the module docstring); returns the files written or changed."""
    if not _NAME.match(name):
        raise ScaffoldError(f"environment name {name!r} must be lower case letters, digits and _, starting with a "
                            "letter (e.g. my_env)")
    if name in BUILTIN:
        raise ScaffoldError(f"{name!r} is a built-in environment; pick another name")
    root = Path(path if path is not None else Path("plugins") / name)
    if root.exists() and any(root.iterdir()):
        raise ScaffoldError(f"{root} exists and is not empty; pass --path to write elsewhere")
    module, cls = f"{name}_env", "".join(part.capitalize() for part in name.split("_"))
    values = {"name": name, "module": module, "cls": cls, "dist": f"rollout-factory-{name.replace('_', '-')}",
              "title": name.replace("_", " ").capitalize()}
    files = {
        root / "pyproject.toml": PYPROJECT.format(**values),
        root / module / "__init__.py": ENV_PY.format(**values),
        root / f"{name}.yaml": CONFIG_YAML.format(**values),
        root / "tests" / f"test_{name}.py": TEST_PY.format(**values),
    }
    for file, text in files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8")
    written = list(files)
    if prefect_yaml is not None and Path(prefect_yaml).exists():
        target = Path(prefect_yaml)
        existing = target.read_text(encoding="utf-8")
        if f"- name: {name}-datagen\n" in existing:
            raise ScaffoldError(f"{target} already has a deployment {name}-datagen; remove it or pick another name")
        base = target.resolve().parent
        config = os.path.relpath((root / f"{name}.yaml").resolve(), base)
        entry = DEPLOYMENT.format(**values, path=os.path.relpath(root.resolve(), base), config=config)
        target.write_text(existing.rstrip("\n") + "\n" + entry, encoding="utf-8")
        written.append(target)
    return written
