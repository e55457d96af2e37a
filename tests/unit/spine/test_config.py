"""Config: YAML plus dotted CLI overrides, CLI > YAML > defaults, unknown keys and wrong types named."""

from __future__ import annotations

import pytest
from pydantic import Field

from factory.config import ConfigError, FactoryConfig, build_config, parse_cli_overrides, split_config_path, to_yaml


class EnvSection(FactoryConfig):
    group_size: int = Field(4, description="Samples per prompt.")
    name: str = Field("bootcamp", description="Environment name.")
    weights: dict[str, float] = Field(default_factory=dict, description="Per-family weights.")


class OpenAISection(FactoryConfig):
    base_url: str | list[str] = Field("http://127.0.0.1:30000/v1", description="Endpoint(s).")
    temperature: float = Field(1.0, description="Sampling temperature.")


class Top(FactoryConfig):
    env: EnvSection = Field(default_factory=EnvSection)
    openai: OpenAISection = Field(default_factory=OpenAISection)
    debug: bool = Field(False, description="Verbose logging.")


def test_parse_both_option_forms_and_yaml_scalars():
    parsed = parse_cli_overrides(["--env.group_size", "8", "--openai.base_url=http://h:1/v1", "--debug", "--openai.temperature", "-0.5"])
    assert parsed == {"env": {"group_size": 8}, "openai": {"base_url": "http://h:1/v1", "temperature": -0.5}, "debug": True}
    assert parse_cli_overrides(["--env.weights", "{a: 1, b: 2}"]) == {"env": {"weights": {"a": 1, "b": 2}}}


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  group_size: 16\n  name: from-yaml\nopenai:\n  temperature: 0.7\n")
    config = build_config(Top, yaml_path=path, cli_args=["--env.group_size", "8"])
    assert config.env.group_size == 8
    assert config.env.name == "from-yaml"
    assert config.openai.temperature == 0.7
    assert config.openai.base_url == "http://127.0.0.1:30000/v1"
    assert build_config(Top, yaml_path=path, values={"env": {"name": "param"}}).env.name == "param"


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'env.group_sze' \(did you mean 'group_size'\?\)"):
        build_config(Top, cli_args=["--env.group_sze", "8"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"config key 'env.group_size'.*got 'eight'"):
        build_config(Top, cli_args=["--env.group_size", "eight"])


def test_bad_files_and_options_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(Top, yaml_path=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        build_config(Top, yaml_path=tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="expected an option"):
        parse_cli_overrides(["group_size", "8"])


def test_config_path_is_split_out_and_resolved_config_dumps():
    assert split_config_path(["process", "--config", "x.yaml", "--env.group_size", "2"]) == (
        "x.yaml",
        ["process", "--env.group_size", "2"],
    )
    assert "group_size: 4" in to_yaml(Top())
