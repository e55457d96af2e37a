"""Every library environment against the starter policy on the local CPU server (one server for the module):
a group is sampled, scored and grouped; multi-turn groups keep whole conversations with only the model's turns
trained. One env also runs through the datagen flow into shards. Kept small: a few seconds per env."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from environments.base import EnvSpec, load_env
from environments.groups import MASK_IGNORE
from factory.inference.client import InferenceClient, InferenceConfig
from factory.store import ShardStore
from flows.env_library import LIBRARY
from tasks.generate import ClientSampler, generate_items, load_tokenizer
from tasks.group import group_chunk
from tasks.score import score_chunk

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STARTER = REPO / "models" / "starter-policy"

CONFIGS: dict[str, dict[str, Any]] = {
    "tool_calling": {"max_tokens": 24, "max_turns": 3, "max_token_length": 512},  # the starter's context is 512
    "blackjack": {"max_tokens": 16, "max_token_length": 512, "max_turns": 3},
    "code_exec": {"max_tokens": 32, "max_token_length": 512, "wall_s": 2.0},
    "math": {"max_tokens": 24, "max_token_length": 512, "data_file": str(REPO / "environments/data/math_sample.jsonl")},
    "multiple_choice": {"max_tokens": 16, "max_token_length": 512,
                        "data_file": str(REPO / "environments/data/mmlu_sample.jsonl")},
    "shape_count": {"max_tokens": 16, "max_token_length": 512},
    "chess": {"max_tokens": 16, "max_token_length": 512},
    "chess_play": {"mode": "play", "diagram": False, "max_moves": 2, "max_tokens": 16, "max_token_length": 512},
    "reasoning_gym": {"max_tokens": 24, "max_token_length": 512, "mix": {"basic_arithmetic": 1, "chain_sum": 1}},
}


@pytest.fixture(scope="module")
def policy_url():
    from factory.inference.local_server import start_local_server

    with start_local_server(STARTER) as handle:
        yield handle.base_url


def sample_groups(name: str, policy_url: str, items: int = 2, group_size: int = 3, api: str = "generate"):
    spec = EnvSpec(LIBRARY[name.removesuffix("_play")], {"group_size": group_size, "tokenizer_name": str(STARTER),
                                                       **CONFIGS[name]})
    env = load_env(spec)
    batch = [env.get_item(i) for i in range(items)]
    tokenizer = load_tokenizer(str(STARTER))

    async def run():
        async with InferenceClient(InferenceConfig(base_url=policy_url, server_type="sglang")) as client:
            return await generate_items(env, batch, ClientSampler(client, tokenizer, api), max_in_flight=8)

    chunk = asyncio.run(run())
    score_chunk(spec, chunk.items, chunk.rollouts, timeout_s=30, workers=1, mode=env.scoring)
    grouped = group_chunk(name, chunk.items, chunk.rollouts, group_size=group_size,
                          max_token_length=env.config.max_token_length, ensure_scores_are_not_same=False)
    return env, chunk, grouped, tokenizer


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_env_samples_scores_and_groups_on_the_starter_policy(name, policy_url):
    env, chunk, grouped, tokenizer = sample_groups(name, policy_url)
    assert chunk.failed_items == 0 and not grouped.dropped, grouped.dropped
    assert len(grouped.groups) == 2
    for group in grouped.groups:
        assert all(isinstance(s, float) for s in group.scores)
        for tokens, masks, conversation in zip(group.tokens, group.masks, group.messages):
            replies = [m for m in conversation if m["role"] == "assistant"]
            assert replies and conversation[: len(env.get_item(0).messages)][0]["role"] in ("system", "user")
            trained = [t for t, m in zip(tokens, masks) if m != MASK_IGNORE]
            assert all(m in (MASK_IGNORE, t) for t, m in zip(tokens, masks))
            # Exactly one end-of-turn token per model turn is trained (or none when cut at max_tokens).
            assert trained.count(tokenizer.eos_token_id) <= len(replies)
            if env.multi_turn:
                untrained = tokenizer.decode([t for t, m in zip(tokens, masks) if m == MASK_IGNORE])
                for message in conversation:
                    if message["role"] != "assistant":
                        assert message["content"] in untrained


def test_multi_turn_env_through_the_datagen_flow(prefect_server, policy_url, tmp_path):
    from flows.env_library import tool_calling_datagen

    summary = tool_calling_datagen(
        config_path=str(REPO / "deployments" / "tool_calling.yaml"),
        env={"group_size": 2, "total_items": 4, "max_tokens": 16, "max_turns": 2, "ensure_scores_are_not_same": False,
             "max_token_length": 512,
             "tokenizer_name": str(STARTER)},
        openai={"base_url": policy_url},
        datagen={"store_root": str(tmp_path), "run_id": "tools", "chunk_items": 4, "score_workers": 1},
    )
    groups = list(ShardStore(tmp_path).iter_groups("tools"))
    assert summary["groups_kept"] == len(groups) == 4
    for group in groups:
        for tokens, masks, conversation in zip(group.tokens, group.masks, group.messages):
            assert conversation[0]["role"] == "system" and conversation[-1]["role"] == "assistant"
            assert sum(m != MASK_IGNORE for m in masks) < len(tokens)


def test_llm_judge_failures_on_a_judge_that_cannot_judge_are_counted_not_scored(policy_url):
    """The starter policy as the judge: it never writes a verdict, so every group fails loudly (unparseable)."""
    from environments.llm_judge import LLMJudgeConfig, LLMJudgeEnv

    env = LLMJudgeEnv(LLMJudgeConfig(group_size=2, max_tokens=8, judge_retries=1, judge_max_tokens=8,
                                     judge={"base_url": policy_url}))
    items = [env.get_item(i) for i in range(2)]
    tokenizer = load_tokenizer(str(STARTER))

    async def run():
        async with InferenceClient(InferenceConfig(base_url=policy_url, server_type="sglang")) as client:
            return await generate_items(env, items, ClientSampler(client, tokenizer, "generate"), max_in_flight=4)

    chunk = asyncio.run(run())
    grouped = group_chunk("llm_judge", chunk.items, chunk.rollouts, group_size=2, max_token_length=512)
    assert grouped.groups == [] and grouped.dropped["failed"] == 2
    assert all(r.score is None and r.error.startswith("judge_unparseable") for g in chunk.rollouts for r in g)
    judge = env.__dict__["_judge"][1]
    assert judge.counts["failures"] >= 2 and judge.counts["retries"] >= 2


@pytest.mark.parametrize("name", ["blackjack", "multiple_choice", "shape_count"])
def test_evaluate_runs_episodes_and_reports_metrics(name, policy_url):
    spec = EnvSpec(LIBRARY[name], {"eval_items": 4, "tokenizer_name": str(STARTER), **CONFIGS[name]})
    env = load_env(spec)
    tokenizer = load_tokenizer(str(STARTER))

    async def run():
        async with InferenceClient(InferenceConfig(base_url=policy_url, server_type="sglang")) as client:
            return await env.evaluate(ClientSampler(client, tokenizer, "generate"))

    metrics, samples = asyncio.run(run())
    assert metrics["items"] == 4 and len(samples) == 4 and 0.0 <= metrics["accuracy"] <= 1.0
    for sample in samples:
        if env.multi_turn:  # the whole greedy episode is the completion that was scored
            assert isinstance(sample["completion"], list) and sample["completion"][-1]["role"] == "assistant"
        else:
            assert isinstance(sample["completion"], str)


def test_multi_turn_over_chat_completions_keeps_masks_consistent(policy_url):
    """An OpenAI-style server templates the messages itself: the episode's ids are our rendering of them."""
    env, chunk, grouped, tokenizer = sample_groups("blackjack", policy_url, api="chat")
    assert chunk.failed_items == 0 and len(grouped.groups) == 2, grouped.dropped
    for group in grouped.groups:
        for tokens, masks, conversation in zip(group.tokens, group.masks, group.messages):
            untrained = tokenizer.decode([t for t, m in zip(tokens, masks) if m == MASK_IGNORE])
            assert all(m["content"] in untrained for m in conversation if m["role"] != "assistant")


def _pip_install_target(target: Path, *packages: Path) -> None:
    """Install packages into `target` only (not the interpreter's site-packages): PYTHONPATH makes them visible."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), *map(str, packages)],
                   check=True, timeout=300, capture_output=True)


def test_plugin_package_is_listed_tested_and_run_like_a_builtin(prefect_server, policy_url, tmp_path):
    """`python -m environments new` writes a package; pip installs it (and a broken plugin) into a --target dir;
    `list` shows both (the broken one with its error), the package's own tests pass, and `run NAME process`
    writes its groups to the store through the datagen flow on the starter policy."""
    import os
    import subprocess
    import sys

    from environments.scaffold import new_env

    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text((REPO / "prefect.yaml").read_text())
    new_env("word_sum", tmp_path / "word_sum", prefect_yaml)
    broken = tmp_path / "broken"
    (broken / "broken_env").mkdir(parents=True)
    (broken / "broken_env" / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    (broken / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "broken-env"\nversion = "0.1.0"\n'
        '[project.entry-points."rollout_factory.environments"]\nbroken = "broken_env:BrokenEnv"\n'
        '[tool.setuptools]\npackages = ["broken_env"]\n')
    site = tmp_path / "site"
    _pip_install_target(site, tmp_path / "word_sum", broken)
    environ = {**os.environ, **prefect_server, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}

    def run(*args, cwd=REPO):
        return subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True,
                              timeout=240)

    listed = run("-m", "environments", "list")
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert "plugin:rollout-factory-word-sum" in lines["word_sum"] and "[ok]" in lines["word_sum"]
    assert "error: ModuleNotFoundError" in lines["broken"] and "[ok]" in lines["chess"]
    tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "word_sum" / "tests"),
                cwd=tmp_path / "word_sum")
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout + tests.stderr
    store = tmp_path / "store"
    done = run("-m", "environments", "run", "word_sum", "process", "--config", str(tmp_path / "word_sum" / "word_sum.yaml"),
               "--env.group_size", "2", "--env.total_items", "2", "--env.max_tokens", "8",
               "--env.ensure_scores_are_not_same", "false", "--env.tokenizer_name", str(STARTER),
               "--openai.base_url", policy_url, "--datagen.store_root", str(store), "--datagen.chunk_items", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    groups = list(ShardStore(store).iter_groups("word_sum"))
    assert len(groups) == 2 and {g.env for g in groups} == {"word_sum"}
