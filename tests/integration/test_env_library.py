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
    done = run("-m", "environments", "run", "word_sum", "process",
               "--config", str(tmp_path / "word_sum" / "word_sum.yaml"),
               "--env.group_size", "2", "--env.total_items", "2", "--env.max_tokens", "8",
               "--env.ensure_scores_are_not_same", "false", "--env.tokenizer_name", str(STARTER),
               "--openai.base_url", policy_url, "--datagen.store_root", str(store), "--datagen.chunk_items", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    groups = list(ShardStore(store).iter_groups("word_sum"))
    assert len(groups) == 2 and {g.env for g in groups} == {"word_sum"}


# ---- every shipped env against the scripted reference policy (environments/reference_policy.py) ----

REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "gsm8k": {"data_file": str(REPO / "environments/data/gsm8k_sample.jsonl")},
    "math": {"data_file": str(REPO / "environments/data/math_sample.jsonl")},
    "multiple_choice": {"data_file": str(REPO / "environments/data/mmlu_sample.jsonl")},
    "reasoning_gym": {"mix": {"basic_arithmetic": 1, "chain_sum": 1}},
    "intern_bootcamp": {},
    "code_exec": {"wall_s": 5.0},
    "shape_count": {},
    "chess": {},
    "chess_play": {"mode": "play", "diagram": False, "max_moves": 2},
    "tool_calling": {"compact_prompt": True, "max_turns": 5, "max_tokens": 144, "max_token_length": 512},
    "blackjack": {"max_turns": 3, "max_token_length": 512},
    "llm_judge": {"opponents": 3},
}
REFERENCE_GROUP, REFERENCE_ITEMS = 4, 8


@pytest.fixture(scope="module")
def reference_server():
    from environments.reference_policy import ReferencePolicy, serve

    policy = ReferencePolicy(REFERENCE_GROUP)
    with serve(policy) as url:
        yield policy, url


def test_every_shipped_env_has_a_reference_case():
    from environments.registry import BUILTIN

    assert set(BUILTIN) <= {name.removesuffix("_play") for name in REFERENCE_CONFIGS}


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_env_scores_the_reference_policy_right_and_wrong(name, reference_server):
    """Right answers score as right, wrong ones as wrong; mixed groups are kept, all-equal ones dropped and counted."""
    from environments.blackjack import play_out
    from environments.reference_policy import _blackjack_plans, is_wrong
    from environments.registry import BUILTIN

    policy, url = reference_server
    config = {"group_size": REFERENCE_GROUP, **REFERENCE_CONFIGS[name]}
    if name == "llm_judge":
        config["judge"] = {"base_url": url, "server_type": "openai", "model_name": "reference-policy"}
    spec = EnvSpec(BUILTIN[name.removesuffix("_play")], config)
    env = load_env(spec)
    items = [env.get_item(i) for i in range(REFERENCE_ITEMS)]
    policy.add(env, items)
    tokenizer = load_tokenizer(str(STARTER))

    async def run():
        config = InferenceConfig(base_url=url, server_type="openai", model_name="reference-policy")
        async with InferenceClient(config) as client:
            return await generate_items(env, items, ClientSampler(client, tokenizer, "chat"), max_in_flight=8)

    chunk = asyncio.run(run())
    assert chunk.failed_items == 0
    score_chunk(spec, chunk.items, chunk.rollouts, timeout_s=60, workers=1, mode=env.scoring)
    grouped = group_chunk(name, chunk.items, chunk.rollouts, group_size=REFERENCE_GROUP,
                          max_token_length=env.config.max_token_length)

    expected_kept = 0
    for item, rollouts in zip(chunk.items, chunk.rollouts):
        def first_reply(r):
            return next(m["content"] for m in r.messages if m["role"] == "assistant") if r.messages else r.text

        right = [r for r in rollouts if not is_wrong(first_reply(r))]
        wrong = [r for r in rollouts if is_wrong(first_reply(r))]
        assert len(right) == policy.right_count(item), item.key
        if name == "llm_judge":  # pairwise: a right answer never loses, a wrong one never wins
            assert all(r.score >= 0.5 for r in right) and all(r.score <= 0.5 for r in wrong)
            separable = True
        elif name == "blackjack":  # the best and the worst plan for the deck, by the env's own rules
            best, worst = _blackjack_plans(env, item)
            convo = [*item.messages, *({"role": "assistant", "content": f"<action>{a}</action>"} for a in best)]
            assert all(r.score == env.score(item, convo) for r in right)
            convo = [*item.messages, *({"role": "assistant", "content": f"<action>{a}</action>"} for a in worst)]
            assert all(r.score == env.score(item, convo) for r in wrong)
            separable = play_out(item.answer, best)[0] != play_out(item.answer, worst)[0]
        else:
            assert all(env.is_correct(item, r.scoring_input()) for r in right), [r.text for r in right]
            assert not any(env.is_correct(item, r.scoring_input()) for r in wrong), [r.text for r in wrong]
            separable = True
        expected_kept += bool(right and wrong and separable)
    assert expected_kept > 0
    assert len(grouped.groups) == expected_kept
    assert grouped.dropped["equal_scores"] == REFERENCE_ITEMS - expected_kept, grouped.dropped
