"""Datagen flows (and deployments) for the environment library: one named flow per environment.

Each is `run_datagen` on the env's import path, exactly like `intern-bootcamp-datagen` in flows/datagen.py;
they live here so adding an environment does not touch the core flow module.

    prefect deployment run tool-calling-datagen/tool-calling-datagen

`env-datagen` runs any environment by name, a plugin's included (environments/registry.py):

    prefect deployment run env-datagen/my-env-datagen
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from environments.registry import BUILTIN, resolve
from flows.datagen import ENVIRONMENTS, run_datagen

LIBRARY = {name: ref for name, ref in BUILTIN.items() if name not in ENVIRONMENTS}
"""Environment name -> import path; each has a `<name>-datagen` flow below and a deployment in prefect.yaml."""


def _run(name: str, env: dict[str, Any] | None, openai: dict[str, Any] | None, datagen: dict[str, Any] | None,
         serve: dict[str, Any] | None, config_path: str | None) -> dict[str, Any]:
    return run_datagen(LIBRARY[name], env=env, openai=openai, datagen=datagen, serve=serve, config_path=config_path)


@flow(name="tool-calling-datagen", retries=2, retry_delay_seconds=30)
def tool_calling_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                         datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                         config_path: str | None = None) -> dict[str, Any]:
    """Multi-turn tool-calling rollouts (deployments/tool_calling.yaml)."""
    return _run("tool_calling", env, openai, datagen, serve, config_path)


@flow(name="code-exec-datagen", retries=2, retry_delay_seconds=30)
def code_exec_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                      datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                      config_path: str | None = None) -> dict[str, Any]:
    """Code-execution rollouts, submissions scored in the sandbox (deployments/code_exec.yaml)."""
    return _run("code_exec", env, openai, datagen, serve, config_path)


@flow(name="reasoning-gym-datagen", retries=2, retry_delay_seconds=30)
def reasoning_gym_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                          datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                          config_path: str | None = None) -> dict[str, Any]:
    """reasoning-gym rollouts: a dataset or weighted mix at a difficulty level (deployments/reasoning_gym.yaml)."""
    return _run("reasoning_gym", env, openai, datagen, serve, config_path)


@flow(name="math-datagen", retries=2, retry_delay_seconds=30)
def math_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                 datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                 config_path: str | None = None) -> dict[str, Any]:
    """MATH rollouts, boxed answers checked by math-verify (deployments/math.yaml, math_sample.yaml)."""
    return _run("math", env, openai, datagen, serve, config_path)


@flow(name="multiple-choice-datagen", retries=2, retry_delay_seconds=30)
def multiple_choice_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                            datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                            config_path: str | None = None) -> dict[str, Any]:
    """MMLU-style multiple-choice rollouts (deployments/multiple_choice.yaml)."""
    return _run("multiple_choice", env, openai, datagen, serve, config_path)


@flow(name="blackjack-datagen", retries=2, retry_delay_seconds=30)
def blackjack_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                      datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                      config_path: str | None = None) -> dict[str, Any]:
    """Multi-step Blackjack rollouts, reward from the hand's outcome (deployments/blackjack.yaml)."""
    return _run("blackjack", env, openai, datagen, serve, config_path)


@flow(name="llm-judge-datagen", retries=2, retry_delay_seconds=30)
def llm_judge_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                      datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                      config_path: str | None = None) -> dict[str, Any]:
    """RLAIF rollouts scored by a judge endpoint, pairwise in both orders (deployments/llm_judge.yaml)."""
    return _run("llm_judge", env, openai, datagen, serve, config_path)


@flow(name="shape-count-datagen", retries=2, retry_delay_seconds=30)
def shape_count_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                        datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                        config_path: str | None = None) -> dict[str, Any]:
    """Multimodal shape counting: generated pictures kept in messages and `images` (deployments/shape_count.yaml)."""
    return _run("shape_count", env, openai, datagen, serve, config_path)


@flow(name="chess-datagen", retries=2, retry_delay_seconds=30)
def chess_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                  datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                  config_path: str | None = None) -> dict[str, Any]:
    """Chess moves scored by legality and a shallow search, or games against a scripted opponent (chess.yaml)."""
    return _run("chess", env, openai, datagen, serve, config_path)


@flow(name="env-datagen", retries=2, retry_delay_seconds=30)
def env_datagen(env_name: str, env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                config_path: str | None = None) -> dict[str, Any]:
    """Rollouts of any environment by name: a built-in or a plugin registered through an entry point."""
    return run_datagen(resolve(env_name), env=env, openai=openai, datagen=datagen, serve=serve, config_path=config_path)
