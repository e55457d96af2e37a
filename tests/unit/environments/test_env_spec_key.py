"""`EnvSpec.config_key`: the sorted-JSON key `load_env` finds an env by, made once per spec (issue 33)."""

from __future__ import annotations

import json
import pickle

from environments.base import EnvSpec, load_env

IB = "environments.intern_bootcamp:InternBootcampEnv"


def test_the_key_is_the_sorted_json_of_the_config_and_is_made_once():
    spec = EnvSpec(IB, {"group_size": 4, "difficulties": [1], "task_name": "arithmetic"})
    assert spec.config_key == json.dumps(spec.config, sort_keys=True, default=str)
    assert spec.config_key is spec.config_key


def test_equal_configs_in_any_order_share_one_env_also_after_pickling():
    a = EnvSpec(IB, {"group_size": 4, "task_name": "arithmetic"})
    b = EnvSpec(IB, {"task_name": "arithmetic", "group_size": 4})
    a.config_key  # cached before pickling: the copy carries it and still finds the same env
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a and copy.config_key == a.config_key
    assert load_env(a, setup=False) is load_env(b, setup=False) is load_env(copy, setup=False)
    other = EnvSpec(IB, {"group_size": 5, "task_name": "arithmetic"})
    assert load_env(other, setup=False) is not load_env(a, setup=False)


def test_sampling_is_made_once_and_always_says_what_the_config_says():
    env = EnvSpec(IB, {"task_name": "arithmetic", "max_tokens": 16}).build()
    first = env.sampling()
    assert env.sampling() is first and (first.temperature, first.top_p, first.max_tokens) == (1.0, 1.0, 16)
    env.config.temperature = 0.5  # a changed config gives new settings
    assert env.sampling().temperature == 0.5 and first.temperature == 1.0
    changed = env.sampling()
    changed.stop = ["</answer>"]  # and so does a settings object that whoever got it changed
    assert env.sampling() is not changed and env.sampling().stop is None
    changed.stop, changed.max_tokens = None, 3
    assert env.sampling().max_tokens == 16
