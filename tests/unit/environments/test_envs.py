"""The shipped environments and the job config: deterministic items, scoring rules, config precedence and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from environments.base import EnvSpec, load_env
from environments.gsm8k import SAMPLE_FILE, GSM8KConfig, GSM8KEnv, gold_answer
from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv
from factory.config import ConfigError
from flows.datagen import ENVIRONMENTS, build_job_config

IB = ENVIRONMENTS["intern_bootcamp"]


def test_intern_bootcamp_items_are_fixed_by_seed_and_index():
    env = InternBootcampEnv(InternBootcampConfig(seed=3, difficulties=[1, 2]))
    again = InternBootcampEnv(InternBootcampConfig(seed=3, difficulties=[1, 2]))
    other = InternBootcampEnv(InternBootcampConfig(seed=4, difficulties=[1, 2]))
    assert [env.get_item(i) for i in range(20)] == [again.get_item(i) for i in range(20)]
    assert [env.get_item(i).key for i in range(20)] != [other.get_item(i).key for i in range(20)]
    assert [env.get_next_item() for _ in range(3)] == [env.get_item(i) for i in range(3)]


def test_intern_bootcamp_single_family_and_unknown_family():
    env = InternBootcampEnv(InternBootcampConfig(task_name="reverse"))
    assert {env.get_item(i).answer.family for i in range(10)} == {"reverse"}
    with pytest.raises(ValueError, match="unknown task 'revers'"):
        InternBootcampConfig(task_name="revers")


def test_intern_bootcamp_eval_metrics_per_family():
    env = InternBootcampEnv()
    items = [env.get_eval_item(i) for i in range(6)]
    completions = [f"<answer>{i.answer.answer}</answer>" for i in items[:3]] + ["?"] * 3
    metrics = env.eval_metrics(items, completions)
    assert metrics["accuracy"] == 0.5
    assert any(key.startswith("accuracy/") for key in metrics)


def test_gsm8k_scores_only_boxed_answers_after_thinking():
    env = GSM8KEnv(GSM8KConfig(data_file=str(SAMPLE_FILE)))
    item = env.get_item(0)
    assert env.score(item, f"<think>work</think> The answer is \\boxed{{{item.answer}}}.") == 1.0
    assert env.score(item, f"\\boxed{{{item.answer}}}") == 0.0                       # no thinking block
    assert env.score(item, f"<think>\\boxed{{{item.answer}}}</think> no box") == 0.0  # box only inside thinking
    assert env.score(item, "<think>x</think> \\boxed{-1}") == 0.0
    assert env.score(item, f"<think>x</think> \\boxed{{{item.answer}.0}}") == 1.0  # math-verify: 26.0 == 26


def test_gsm8k_sample_file_covers_epochs_with_distinct_keys():
    env = GSM8KEnv(GSM8KConfig(data_file=str(SAMPLE_FILE)))
    env.setup()
    keys = [env.get_item(i).key for i in range(2 * len(env.rows))]
    assert len(set(keys)) == len(keys)
    assert gold_answer("so 1,200 in all\n#### 1,200") == "1200"


def test_gsm8k_missing_file_names_the_field(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="env.data_file"):
        GSM8KEnv(GSM8KConfig(data_file=str(tmp_path / "nope.jsonl"))).setup()


def test_env_spec_rebuilds_and_caches_the_env():
    spec = EnvSpec(IB, {"group_size": 4})
    assert load_env(spec) is load_env(spec)
    assert load_env(spec).config.group_size == 4
    with pytest.raises(ValueError, match="package.module:ClassName"):
        EnvSpec("environments.nope:Env", {}).build()


def test_job_config_precedence_and_defaults(tmp_path: Path):
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("env: {group_size: 8, total_items: 50}\ndatagen: {chunk_items: 10}\n")
    cfg = build_job_config(IB, config_path=str(yaml_file), values={"env": {"group_size": 6}},
                           cli_args=["--env.group_size", "4", "--openai.base_url", "http://h:1"])
    assert cfg.env.group_size == 4 and cfg.env.total_items == 50 and cfg.datagen.chunk_items == 10
    assert cfg.openai.base_url == "http://h:1"
    assert cfg.datagen.run_id == "intern-bootcamp" and cfg.datagen.producer == "intern-bootcamp"
    assert isinstance(cfg.env, InternBootcampConfig)


@pytest.mark.parametrize(("args", "message"), [
    (["--env.group_sze", "3"], "did you mean 'group_size'"),
    (["--env.difficulties", "[7]"], "env.difficulties"),
    (["--env.weights", "{sortng: 1}"], "sortng"),
    (["--datagen.task_runner", "ray"], "datagen.task_runner"),
])
def test_bad_job_config_names_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        build_job_config(IB, cli_args=args)
