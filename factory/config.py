"""One config shape everywhere: pydantic models, a YAML file, and Atropos-style dotted CLI overrides.

Precedence is CLI > YAML > defaults. `--env.group_size 8`, `--env.group_size=8`
and `--openai.base_url http://…` address nested fields by their dotted path,
which are the same keys the flows take as parameters in `prefect.yaml`.
Unknown keys and wrong types fail with a `ConfigError` that names the key.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names the key and the fix."""


class FactoryConfig(BaseModel):
    """Base for every config model: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def parse_cli_overrides(args: Sequence[str]) -> dict[str, Any]:
    """Turn `--a.b 1 --c=x --flag` into a nested dict; values are parsed as YAML scalars."""
    overrides: dict[str, Any] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected an option like --env.group_size, got {arg!r}")
        key, has_value, raw = arg[2:].partition("=")
        if not has_value:
            if index + 1 < len(args) and not args[index + 1].startswith("--"):
                raw = args[index + 1]
                index += 1
            else:
                raw = "true"
        index += 1
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"option {arg!r} has an empty key part")
        _set_dotted(overrides, key.replace("-", "_"), _parse_value(raw))
    return overrides


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = target
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{'.'.join(parents[: i + 1])} is set as a value and as a section")
        node = child
    node[leaf] = value


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge `override` into a copy of `base`, recursing into nested sections."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def build_config(
    model: type[M], *, yaml_path: str | Path | None = None, cli_args: Sequence[str] = (), values: dict[str, Any] | None = None
) -> M:
    """Defaults < YAML file < `values` (e.g. flow parameters) < CLI overrides, validated into `model`."""
    from_yaml: dict[str, Any] = load_yaml(yaml_path) if yaml_path else {}
    from_cli = parse_cli_overrides(cli_args)
    data = deep_merge(deep_merge(from_yaml, values or {}), from_cli)
    # Highest precedence first: an error names where the bad key came from.
    sources = [("the command line", from_cli), ("the flow parameters", values or {}), (f"config file {yaml_path}", from_yaml)]
    return validate_config(model, data, sources=sources)


def validate_config(model: type[M], data: dict[str, Any], *, sources: Sequence[tuple[str, dict[str, Any]]] = ()) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_explain(model, error, sources)) from None


def _source_of(loc: tuple[Any, ...], sources: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """' (in config file X)' / ' (from the command line)' for the first source that sets `loc`, else ''."""
    for label, data in sources:
        node: Any = data
        for part in loc:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return f" (in {label})" if label.startswith("config file") else f" (from {label})"
    return ""


def _explain(model: type[BaseModel], error: ValidationError, sources: Sequence[tuple[str, dict[str, Any]]] = ()) -> str:
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"])
        where = _source_of(problem["loc"], sources)
        if problem["type"] == "extra_forbidden":
            hint = _did_you_mean(model, problem["loc"])
            lines.append(f"unknown config key '{key}'{hint}{where}")
        else:
            lines.append(f"config key '{key}': {problem['msg']} (got {problem.get('input')!r}){where}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _did_you_mean(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    node: Any = model
    for part in loc[:-1]:
        field = getattr(node, "model_fields", {}).get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        node = field.annotation
    known = list(getattr(node, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(known)})"


def split_config_path(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull `--config PATH` out of CLI args; return (path, remaining args)."""
    remaining: list[str] = []
    path = None
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--config" and index + 1 < len(args):
            path = args[index + 1]
            index += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            remaining.append(arg)
        index += 1
    return path, remaining


def to_yaml(config: BaseModel) -> str:
    """The resolved config as YAML, to leave next to a run's shards."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
