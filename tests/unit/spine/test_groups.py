"""The ScoredGroup contract: Atropos's wire fields validate as they are, bad groups are refused with the field named."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from environments.groups import GROUP_WIRE_FIELDS, ScoredGroup, content_group_id, make_group_id


def good(**overrides):
    fields = dict(
        tokens=[[1, 2, 3], [1, 2, 4, 5]],
        masks=[[-100, 2, 3], [-100, 2, 4, 5]],
        scores=[1.0, -1.0],
        inference_logprobs=[[1.0, -0.1, -0.2], [1.0, -0.3, -0.4, -0.5]],
    )
    fields.update(overrides)
    return fields


def test_atropos_scored_data_body_validates_unchanged():
    body = {name: None for name in GROUP_WIRE_FIELDS} | good(env_id=3, messages=[[{"role": "user", "content": "hi"}]] * 2)
    group = ScoredGroup.model_validate(body)
    assert group.wire_dict() == body
    assert group.group_size == 2


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(masks=[[-100, 2, 3], [-100, 2]]), "masks[1]"),
        (dict(inference_logprobs=[[1.0, 0.0, 0.0]]), "inference_logprobs has 1 entries"),
        (dict(scores=[1.0, math.nan]), "scores[1]"),
        (dict(scores=[math.inf, 0.0]), "scores[0]"),
        (dict(scores=[1.0]), "scores has 1 entries"),
        (dict(tokens=[], masks=[], scores=[], inference_logprobs=None), "at least one sequence"),
        (dict(tokens=[[1], []], masks=[[1], []], inference_logprobs=None), "tokens[1] is empty"),
        (dict(advantages=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0, math.nan]]), "advantages[1][3]"),
        (dict(messages=[[{"role": "user"}], [{"role": "user", "content": "x"}]]), "messages[0][0]"),
        (dict(tokens=[[1, 2, "x"], [1, 2, 4, 5]]), "tokens"),
        (dict(distill_token_ids=[[[1]] * 3, [[1]] * 3], distill_logprobs=[[[0.0]] * 3, [[0.0]] * 4]), "distill_token_ids[1]"),
    ],
)
def test_invalid_groups_name_the_field_and_index(overrides, named):
    with pytest.raises(ValidationError) as error:
        ScoredGroup.model_validate(good(**overrides))
    assert named in str(error.value)


def test_unknown_fields_are_refused():
    with pytest.raises(ValidationError, match="tokenz"):
        ScoredGroup.model_validate(good(tokenz=[[1]]))


def test_group_id_is_deterministic_and_content_based_when_absent():
    assert make_group_id("env", "k", 1, 2) == make_group_id("env", "k", 1, 2)
    assert make_group_id("env", "k", 1, 2) != make_group_id("env", "k", 1, 3)
    a, b = ScoredGroup.model_validate(good()), ScoredGroup.model_validate(good())
    assert a.group_id == b.group_id == content_group_id(a.tokens, a.scores, None)
    assert ScoredGroup.model_validate(good(scores=[0.0, 1.0])).group_id != a.group_id
    assert ScoredGroup.model_validate(good(group_id="given")).group_id == "given"


def test_created_at_is_utc():
    from datetime import datetime, timedelta, timezone

    local = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    group = ScoredGroup.model_validate(good(created_at=local))
    assert group.created_at.utcoffset() == timedelta(0)
    assert group.created_at == local


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(masks=[[-100, 2, 3], [-100, 2]]), "masks[1] has 2 entries but tokens[1] has 4"),
        # masks and logprobs both wrong in sequence 0: masks is named first, as before issue 33's hoisted lookups
        (dict(masks=[[-100], [-100, 2, 4, 5]], inference_logprobs=[[1.0], [1.0, -0.3, -0.4, -0.5]]),
         "masks[0] has 1 entries but tokens[0] has 3"),
        # an earlier sequence's problem is found before a later one's, whatever the field
        (dict(inference_logprobs=[[1.0, 0.0], [1.0]], masks=[[-100, 2, 3], [-100]]),
         "inference_logprobs[0] has 2 entries but tokens[0] has 3"),
        (dict(tokens=[[], [1, 2, 4, 5]], masks=[[], [-100, 2]]), "tokens[0] is empty"),
        (dict(distill_token_ids=[[[1]] * 2, [[1]] * 4], distill_logprobs=[[[0.0]] * 3, [[0.0]] * 4]),
         "distill_token_ids[0] has 2 positions but tokens[0] has 3"),
        (dict(distill_token_ids=[[[1]] * 3, [[1]] * 4], distill_logprobs=[[[0.0]] * 3, [[0.0]] * 2]),
         "distill_logprobs[1] has 2 positions but tokens[1] has 4"),
    ],
)
def test_per_sequence_shape_errors_say_exactly_what_and_where(overrides, message):
    with pytest.raises(ValidationError) as error:
        ScoredGroup.model_validate(good(**overrides))
    assert message in str(error.value)
