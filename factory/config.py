"""One config shape everywhere: pydantic models, a YAML file, and Atropos-style dotted CLI overrides.

Precedence is CLI > YAML > defaults. `--env.group_size 8`, `--env.group_size=8`
and `--openai.base_url http://…` address nested fields by their dotted path,
which are the same keys the flows take as parameters in `prefect.yaml`.
Unknown keys and wrong types fail with a `ConfigError` that names the key.
"""

from __future__ import annotations

import difflib
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined

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
    """Defaults < YAML file < `values` (e.g. flow parameters) < CLI overrides, validated into `model`.

    `--help`/`-h` among `cli_args` prints `config_help(model)` (every key, its type, default and description)
    and exits 0, so each entry point built on this answers --help from the same model that parses it.
    """
    if wants_help(cli_args):
        print(config_help(model))
        raise SystemExit(0)
    from_yaml: dict[str, Any] = load_yaml(yaml_path) if yaml_path else {}
    from_cli = parse_cli_overrides(cli_args)
    data = deep_merge(deep_merge(from_yaml, values or {}), from_cli)
    # Highest precedence first: an error names where the bad key came from.
    sources = [("the command line", from_cli), ("the flow parameters", values or {}),
               (f"config file {yaml_path}", from_yaml)]
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


HELP_FLAGS = ("--help", "-h")


def wants_help(args: Sequence[str]) -> bool:
    """Whether a command line asks for help (`--help` or `-h` anywhere, not as an option's value)."""
    return any(arg in HELP_FLAGS for arg in args)


def prog_name() -> str:
    """How the running command was invoked: `python -m flows.train`, `python environments/gsm8k.py`, `run-api`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return "python -m " + spec.name.removesuffix(".__main__")
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    return f"python {argv0}" if argv0.endswith(".py") else Path(argv0).name


def config_help(model: type[BaseModel], *, prog: str | None = None, usage_args: str = "",
                description: str | None = None, extra_options: Sequence[tuple[str, str]] = ()) -> str:
    """A --help text generated from `model`: every (dotted) key with its type, default and field description.

    `description` defaults to the running script's module docstring, which holds its examples.
    `extra_options` are (flag, description) pairs the command takes besides the model's keys.
    """
    prog = prog or prog_name()
    if description is None:
        description = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    head = f"usage: {prog} {usage_args + ' ' if usage_args else ''}[--config FILE.yaml] [--KEY VALUE | --KEY=VALUE ...]"
    lines = [head, ""]
    if description:
        lines += [description, ""]
    doc = (model.__doc__ or "").strip().splitlines()
    if doc and doc[0]:
        lines += [doc[0], ""]
    lines += [
        "Options are the config's keys, dotted for nested sections (--section.key VALUE); values are read as YAML",
        "(--xs '[1, 2]', --flag true). Precedence: command line > --config file > defaults.",
        "",
        "options:",
        _option("-h, --help", "Show this help and exit."),
        _option("--config FILE", "YAML file holding any of the keys below (same nesting)."),
    ]
    lines += [_option(flag, text) for flag, text in extra_options]
    _field_lines(model, "", lines)
    return "\n".join(lines)


def _option(flag: str, text: str, meta: str = "") -> str:
    body = textwrap.fill(" ".join(text.split()), width=100, initial_indent="      ", subsequent_indent="      ")
    return f"  {flag}{'  ' + meta if meta else ''}\n{body}" if text else f"  {flag}{'  ' + meta if meta else ''}"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a nested section (`Sub`, `Sub | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "computed"
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "see keys below"
    return f"default {value!r}" if not isinstance(value, str) else f"default {value!r}"


def _field_lines(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_model(field.annotation)
        text = field.description or ""
        if section is not None:
            lines.append("")
            lines.append(_option(f"--{key}.*", text or (section.__doc__ or "").strip().split("\n")[0], "(section)"))
            _field_lines(section, f"{key}.", lines)
            continue
        meta = f"({_type_name(field.annotation)}, {_default_text(field)})"
        lines.append(_option(f"--{key}", text, meta))


def merge_run_parameters(defaults: dict[str, Any] | None, given: dict[str, Any | None]) -> dict[str, Any]:
    """A run's parameters merged key by key into its deployment's defaults (None: the parameter was not given).

    Prefect replaces a deployment's parameter wholesale when a run sets it, so `--params '{"env": {"total_items":
    8}}'` would drop every other key of the deployment's `env`; merged here, only `env.total_items` changes.
    """
    merged: dict[str, Any] = {}
    for name, value in given.items():
        default = (defaults or {}).get(name)
        if isinstance(default, dict) and isinstance(value, dict):
            merged[name] = deep_merge(default, value)
        else:
            merged[name] = default if value is None else value
    return merged


def deployment_defaults() -> dict[str, Any]:
    """The parameters of the deployment this flow run was started from ({} outside a deployment run)."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext
    except ImportError:  # pragma: no cover - prefect is a dependency
        return {}
    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context and context.flow_run else None
    if deployment_id is None:
        return {}
    try:
        with get_client(sync_client=True) as client:
            return dict(client.read_deployment(deployment_id).parameters or {})
    except Exception:  # noqa: BLE001 - no API reachable: the run's own parameters stand alone
        return {}


def deployment_sections(**given: dict[str, Any] | None) -> dict[str, Any]:
    """A flow's config sections, each merged key by key into its deployment's (outside a deployment run: as given);
    sections not given and not in the deployment are left out."""
    merged = merge_run_parameters(deployment_defaults(), given)
    return {name: value for name, value in merged.items() if value}
