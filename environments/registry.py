"""Every environment by name: the built-in ones, and plugins that other packages register through an entry point.

A package adds an environment without touching this repository by declaring, in its pyproject.toml::

    [project.entry-points."rollout_factory.environments"]
    my_env = "my_package.env:MyEnv"

Once it is installed, `my_env` is listed (`python -m environments list`), configured and run like a built-in
(`python -m environments run my_env process --config my_env.yaml --env.group_size 8`), deployed through the
`env-datagen` flow (`flows/env_library.py`, parameter `env_name: my_env`) and served with the `serve` mode.
A plugin whose import fails is listed with its error; it never stops the others from loading.
`python -m environments new NAME` writes such a package (see `environments/scaffold.py`).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rollout_factory.environments"

BUILTIN = {
    "intern_bootcamp": "environments.intern_bootcamp:InternBootcampEnv",
    "gsm8k": "environments.gsm8k:GSM8KEnv",
    "tool_calling": "environments.tool_calling:ToolCallingEnv",
    "code_exec": "environments.code_exec:CodeExecEnv",
    "reasoning_gym": "environments.reasoning_gym_env:ReasoningGymEnv",
    "math": "environments.math_env:MathEnv",
    "multiple_choice": "environments.multiple_choice:MultipleChoiceEnv",
    "blackjack": "environments.blackjack:BlackjackEnv",
    "llm_judge": "environments.llm_judge:LLMJudgeEnv",
    "shape_count": "environments.shape_count:ShapeCountEnv",
    "chess": "environments.chess_env:ChessEnv",
}
"""The environments of this repository: name -> `module:Class`."""


@dataclass(frozen=True)
class EnvEntry:
    """One listed environment: its name, import path, where it comes from, and why it cannot load (or None)."""

    name: str
    ref: str
    source: str
    """"builtin", or "plugin:<distribution>" for an entry point."""
    error: str | None = None


def _check(ref: str) -> str | None:
    """None if `ref` imports to a BaseEnv subclass, else the reason it does not."""
    from environments.base import BaseEnv

    module, _, attr = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as error:  # a plugin's import may fail in any way; it is reported, not raised
        return f"{type(error).__name__}: {error}"
    if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
        return f"{ref} is {cls!r}, not a BaseEnv subclass"
    return None


def plugins() -> list[EnvEntry]:
    """Environments registered by installed packages under the `rollout_factory.environments` entry point group."""
    found = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(point.dist, "name", None) or "?"
        found.append(EnvEntry(point.name, point.value, f"plugin:{dist}"))
    return sorted(found, key=lambda e: e.name)


def discover(check: bool = True) -> list[EnvEntry]:
    """Built-ins then plugins; with `check`, each is imported and a failure is kept as its `error`.

    A plugin with a built-in's name is listed with an error and does not replace the built-in.
    """
    entries = [EnvEntry(name, ref, "builtin") for name, ref in BUILTIN.items()]
    seen = set(BUILTIN)
    for entry in plugins():
        if entry.name in seen:
            entries.append(EnvEntry(entry.name, entry.ref, entry.source,
                                    f"name {entry.name!r} is already taken; rename the entry point"))
            continue
        seen.add(entry.name)
        entries.append(entry)
    if check:
        entries = [e if e.error else EnvEntry(e.name, e.ref, e.source, _check(e.ref)) for e in entries]
    for entry in entries:
        if entry.error and entry.source != "builtin":
            logger.warning("environment plugin %s (%s) cannot be loaded: %s", entry.name, entry.ref, entry.error)
    return entries


def resolve(name: str) -> str:
    """The `module:Class` of an environment name (built-in or plugin); a `module:Class` is returned as it is."""
    if ":" in name:
        return name
    if name in BUILTIN:
        return BUILTIN[name]
    matches = [e for e in plugins() if e.name == name]
    if matches:
        return matches[0].ref
    known = sorted(set(BUILTIN) | {e.name for e in plugins()})
    raise ValueError(f"unknown environment {name!r}; known: {', '.join(known)} "
                     "(install a plugin package that registers it, or pass 'package.module:ClassName')")
