from __future__ import annotations

import math

import pytest

from factory.train.advantages import group_relative, token_advantages
from factory.train.batch import to_sequences


def test_mean_centred_and_std_normalised():
    assert group_relative([1.0, 0.0, 0.0, -1.0]) == [1.0, 0.0, 0.0, -1.0]
    assert group_relative([1.0, 1.0, -0.5, -0.5]) == [0.75, 0.75, -0.75, -0.75]
    std = math.sqrt(0.5)
    assert group_relative([1.0, 0.0, 0.0, -1.0], scale=True, eps=0.0) == pytest.approx([1 / std, 0, 0, -1 / std])
    assert group_relative([2.0, 2.0], scale=True) == [0.0, 0.0]


def test_data_advantages_are_used_as_given():
    group = {"tokens": [[1, 2, 3], [1, 2]], "masks": [[-100, 2, 3], [-100, 2]], "scores": [1.0, 0.0],
             "advantages": [[0.0, 0.3, 0.7], [0.0, -2.0]]}
    assert token_advantages(group) == [[0.0, 0.3, 0.7], [0.0, -2.0]]


def test_set_advantage_to_zero_overrides():
    base = {"tokens": [[1, 2], [1, 3], [1, 4]], "masks": [[-100, 2], [-100, 3], [-100, 4]], "scores": [1.0, 0.0, -1.0]}
    per_seq = token_advantages({**base, "overrides": [{}, {}, {"set_advantage_to_zero": True}]})
    assert per_seq == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    whole = token_advantages({**base, "group_overrides": {"set_advantage_to_zero": True}})
    assert whole == [[0.0, 0.0]] * 3


def test_zero_advantage_groups_are_counted():
    flat = {"tokens": [[1, 2], [1, 3]], "masks": [[-100, 2], [-100, 3]], "scores": [0.5, 0.5]}
    live = {"tokens": [[1, 2], [1, 3]], "masks": [[-100, 2], [-100, 3]], "scores": [1.0, 0.0], "policy_version": 3}
    batch = to_sequences([flat, live])
    assert (batch.groups, batch.zero_advantage_groups, batch.policy_versions) == (2, 1, [3])
