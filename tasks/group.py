"""Rollouts -> `ScoredGroup`s: tokens, masks, aligned inference logprobs and messages, with drop reasons counted.

A group is dropped (and counted by reason, in this order) when a rollout
failed to generate or score (`failed`), when it has fewer or more sequences
than `group_size` (`wrong_size`), when any sequence is longer than
`max_token_length` (`too_long`, as Atropos drops the whole group), or when
every score is the same (`equal_scores`: no GRPO signal).
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from environments.base import Item, Rollout
from environments.groups import MASK_IGNORE, ScoredGroup, make_group_id
from factory import schema
from factory.group_columns import GroupColumns, one_reply_messages_json
from tasks.generate import GeneratedChunk

logger = logging.getLogger(__name__)

DROP_REASONS = ("failed", "wrong_size", "too_long", "equal_scores")


class GroupedChunk:
    """The kept groups of a chunk and what was dropped, with the counts the summary needs.

    `groups` is a sequence of `ScoredGroup`s: as `GroupColumns` (flat arrays, no pydantic object per group) when
    `group_chunk` built it, else a list. A plain class, not a dataclass, so Prefect does not walk every token
    when it is passed between tasks.
    """

    def __init__(self, groups: Sequence[ScoredGroup]) -> None:
        self.groups = groups
        self.dropped: Counter[str] = Counter()
        self.rollouts = 0
        self.completion_tokens = 0
        self.score_sum = 0.0
        self.scored = 0
        self.generate_s = 0.0
        self.generate_started_at = 0.0
        self.outcomes: list[tuple[Item, list[float] | None]] = []
        """Every item of the chunk in order with its rollout scores (None if any rollout failed): the curriculum's input."""
        self.worker: dict[str, Any] = {}

    def __iter__(self) -> Iterator[ScoredGroup]:
        """The kept groups, so the chunk itself goes to the shard writer (ShardStore.commit takes an iterable)."""
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def to_record_batch(self) -> pa.RecordBatch:
        """The kept groups as a shard's rows (ShardStore.commit writes these instead of iterating the groups)."""
        if isinstance(self.groups, GroupColumns):
            return self.groups.to_record_batch()
        return schema.groups_to_record_batch(self.groups)

    def release(self) -> None:
        """Drop the groups and items once the chunk is committed; the counts stay. The rollout task run's Prefect
        state keeps its result (this object) until a garbage collection frees a reference cycle it sits in, so
        without this a committed chunk's items and scores outlived it and made the collector walk them (issue 33)."""
        self.groups = GroupColumns()
        self.outcomes = []

    def stats(self) -> dict[str, Any]:
        return {
            "groups_kept": len(self.groups),
            "dropped": {reason: self.dropped.get(reason, 0) for reason in DROP_REASONS},
            "rollouts": self.rollouts,
            "completion_tokens": self.completion_tokens,
            "score_sum": self.score_sum,
            "scored": self.scored,
            "generate_s": round(self.generate_s, 4),
            "generate_started_at": self.generate_started_at,
            "worker": self.worker,
        }


def sequence_tokens(rollout: Rollout) -> tuple[list[int], list[int], list[float] | None]:
    """(tokens, masks, inference_logprobs) for one rollout: prompt positions (and, in multi-turn rollouts, the
    environment's turns) masked and given logprob 1.0; only the model's own tokens are trained on."""
    prompt = rollout.prompt_token_ids or ()
    output = rollout.output_token_ids or ()
    trained = rollout.output_mask
    masks = [MASK_IGNORE] * len(prompt)
    if trained is None:  # one reply: every output token is the model's (the common case, without a per-token loop)
        masks += output
    else:  # a mask shorter than the output cuts the masks short, as zip does (the group then fails validation)
        masks += [t if keep else MASK_IGNORE for t, keep in zip(output, trained)]
    logprobs = None
    if rollout.output_logprobs is not None and len(rollout.output_logprobs) == len(output):
        logprobs = [1.0] * len(prompt)
        if trained is None:
            logprobs += map(float, rollout.output_logprobs)
        else:
            logprobs += [float(x) if keep else 1.0 for x, keep in zip(rollout.output_logprobs, trained)]
    return [*prompt, *output], masks, logprobs


_IGNORED = array("i", [MASK_IGNORE])
_PROMPT_LOGPROB = array("d", [1.0])


def sequence_arrays(rollout: Rollout, prompts: dict[int, tuple[Any, array, array]]
                    ) -> tuple[array, array, array | None]:
    """`sequence_tokens` as int32 / float64 arrays, the form `GroupColumns` stores. The ids are converted once each:
    a prompt list shared by a group's rollouts (as a server's one `prompt_token_ids` is) once per group, through
    `prompts` (by id, the list kept beside its arrays), and an answer's ids once for its tokens and masks. Raises
    TypeError or OverflowError for an id that is not an int32 integer (the caller then takes `sequence_tokens`)."""
    if rollout.output_mask is not None:  # multi-turn: the lists' own rules, then arrays
        tokens, masks, logprobs = sequence_tokens(rollout)
        return array("i", tokens), array("i", masks), None if logprobs is None else array("d", logprobs)
    prompt = rollout.prompt_token_ids or ()
    converted = prompts.get(id(prompt))
    if converted is None or converted[0] is not prompt:
        converted = prompts[id(prompt)] = (prompt, array("i", prompt), _IGNORED * len(prompt))
    output = array("i", rollout.output_token_ids or ())
    logprobs = rollout.output_logprobs
    if logprobs is not None and len(logprobs) == len(output):
        logprobs = _PROMPT_LOGPROB * len(prompt) + array("d", logprobs)
    else:
        logprobs = None
    return converted[1] + output, converted[2] + output, logprobs


def build_group(env: str, item: Item, rollouts: Sequence[Rollout], **options: Any) -> ScoredGroup | str:
    """The group for one item, or the reason it is dropped (one of DROP_REASONS); `options` as `group_fields`'s."""
    fields = group_fields(env, item, rollouts, **options)
    return fields if isinstance(fields, str) else ScoredGroup(**fields)


def group_fields(
    env: str,
    item: Item,
    rollouts: Sequence[Rollout],
    *,
    group_size: int,
    max_token_length: int,
    ensure_scores_are_not_same: bool = True,
    run_id: str = "",
    seed: int = 0,
    generation_params: dict[str, Any] | None = None,
    arrays: bool = False,
) -> dict[str, Any] | str:
    """`build_group`'s ScoredGroup as the keyword arguments it is made of (not validated), or the drop reason.
    `arrays`: for `GroupColumns.add`: tokens, masks and logprobs as arrays (`sequence_arrays`) where every id
    allows, and one-reply messages as their stored JSON (`messages_json`)."""
    if any(r.error is not None or r.score is None or not r.output_token_ids or not r.prompt_token_ids for r in rollouts):
        return "failed"
    if len(rollouts) != group_size:
        return "wrong_size"
    sequences: list[tuple[Any, Any, Any]] = []
    if arrays:
        prompts: dict[int, tuple[Any, array, array]] = {}
        try:
            sequences = [sequence_arrays(r, prompts) for r in rollouts]
        except (TypeError, OverflowError):
            sequences = []
    if not sequences:
        sequences = [sequence_tokens(r) for r in rollouts]
    if any(len(tokens) > max_token_length for tokens, _, _ in sequences):
        return "too_long"
    scores = [float(r.score) for r in rollouts]  # type: ignore[arg-type]
    if ensure_scores_are_not_same and len(scores) > 1 and len(set(scores)) == 1:
        return "equal_scores"
    logprobs = [lp for _, _, lp in sequences]
    policy_version = min(r.policy_version for r in rollouts)
    messages: dict[str, Any] = {}
    if arrays and all(r.messages is None and type(r.text) is str for r in rollouts):
        messages["messages_json"] = one_reply_messages_json(item.messages, [r.text for r in rollouts])
    if messages.get("messages_json") is None:
        messages = {"messages": [r.messages if r.messages is not None
                                 else [*item.messages, {"role": "assistant", "content": r.text}] for r in rollouts]}
    return {
        "tokens": [t for t, _, _ in sequences],
        "masks": [m for _, m, _ in sequences],
        "scores": scores,
        "inference_logprobs": None if any(lp is None for lp in logprobs) else logprobs,
        **messages,
        "generation_params": generation_params,
        "images": item.info.get("images"),  # multimodal items: the prompt's pictures, kept with the group
        "group_id": make_group_id(env, item.key, seed, policy_version),
        "env": env,
        "item_key": item.key,
        "policy_version": policy_version,
        "run_id": run_id,
        "difficulty": item.info.get("difficulty"),
    }


def _shared_prompt_group(result: GroupedChunk, env: str, item: Item, rollouts: Sequence[Rollout],
                         options: dict[str, Any]) -> str | bool | None:
    """`group_chunk`'s step for the common group (one reply per rollout, one prompt list shared by all, none
    failed): added to `result.groups` straight from the rollouts, and counted; True, or the drop reason. None
    (nothing done) for any other group, which then takes `group_fields`; both write the same rows
    (tests/unit/tasks/test_group_columns.py)."""
    prompt = rollouts[0].prompt_token_ids if rollouts else None
    if type(prompt) is not list or not prompt:
        return None
    outputs, scores, texts = [], [], []
    logprobs: list[Any] | None = []
    for r in rollouts:
        output = r.output_token_ids
        if (r.error is not None or r.score is None or type(output) is not list or not output
                or r.prompt_token_ids is not prompt or r.messages is not None or r.output_mask is not None
                or type(r.text) is not str):
            return None
        outputs.append(output)
        scores.append(float(r.score))
        texts.append(r.text)
        if logprobs is not None:
            values = r.output_logprobs
            if values is None or len(values) != len(output):
                logprobs = None
            else:
                logprobs.append(values)
    reason: str | None = None
    if len(rollouts) != options["group_size"]:
        reason = "wrong_size"
    elif len(prompt) + max(map(len, outputs)) > options["max_token_length"]:
        reason = "too_long"
    elif options["ensure_scores_are_not_same"] and len(scores) > 1 and len(set(scores)) == 1:
        reason = "equal_scores"
    else:
        messages_json = one_reply_messages_json(item.messages, texts)
        policy_version = min([r.policy_version for r in rollouts])
        if messages_json is None or not result.groups.add_shared_prompt(
                prompt=prompt, outputs=outputs, logprobs=logprobs, scores=scores, messages_json=messages_json,
                generation_params=options["generation_params"], images=item.info.get("images"),
                group_id=make_group_id(env, item.key, options["seed"], policy_version), env=env,
                item_key=item.key, policy_version=policy_version, run_id=options["run_id"],
                difficulty=item.info.get("difficulty")):
            return None
    result.rollouts += len(rollouts)
    result.completion_tokens += sum(map(len, outputs))
    score_sum = result.score_sum
    for score in scores:  # one by one, in order, as the general path adds them: the same float
        score_sum += score
    result.score_sum = score_sum
    result.scored += len(scores)
    result.outcomes.append((item, scores))
    return reason or True


def group_chunk(
    env: str,
    items: Sequence[Item],
    rollouts: Sequence[Sequence[Rollout]],
    *,
    group_size: int,
    max_token_length: int,
    ensure_scores_are_not_same: bool = True,
    run_id: str = "",
    seed: int = 0,
    generation_params: dict[str, Any] | None = None,
) -> GroupedChunk:
    """Group every item of a chunk, counting drops by reason."""
    if len(items) != len(rollouts):
        raise ValueError(f"group_chunk got {len(items)} items but {len(rollouts)} rollout lists; they must pair up")
    result = GroupedChunk(groups=GroupColumns())
    options = {"group_size": group_size, "max_token_length": max_token_length, "run_id": run_id, "seed": seed,
               "ensure_scores_are_not_same": ensure_scores_are_not_same, "generation_params": generation_params}
    for item, group_rollouts in zip(items, rollouts):
        columnar = isinstance(result.groups, GroupColumns)
        if columnar and (outcome := _shared_prompt_group(result, env, item, group_rollouts, options)) is not None:
            if outcome is not True:
                result.dropped[outcome] += 1
            continue
        result.rollouts += len(group_rollouts)
        for r in group_rollouts:
            result.completion_tokens += len(r.output_token_ids or [])
            if r.score is not None:
                result.score_sum += r.score
                result.scored += 1
        fields = group_fields(env, item, group_rollouts, arrays=columnar, **options)
        failed = any(r.error is not None or r.score is None for r in group_rollouts)
        result.outcomes.append((item, None if failed else [float(r.score) for r in group_rollouts]))  # type: ignore[arg-type]
        if isinstance(fields, str):
            result.dropped[fields] += 1
        elif not (columnar and result.groups.add(**fields)):
            if columnar:  # lists for pydantic: its coercions, checks and messages (a bad group raises, as it did)
                fields = group_fields(env, item, group_rollouts, **options)
            group = ScoredGroup(**fields)  # type: ignore[arg-type]
            if columnar:  # a group the columns cannot hold as it is: the rest of the chunk as ScoredGroups (rare)
                result.groups = list(result.groups)
            result.groups.append(group)
    if result.dropped:
        logger.debug("chunk of %d items: dropped %s", len(items), dict(result.dropped))
    return result


def group_generated(
    env: str,
    chunk: GeneratedChunk,
    *,
    group_size: int,
    max_token_length: int,
    ensure_scores_are_not_same: bool = True,
    run_id: str = "",
    seed: int = 0,
    generation_params: dict[str, Any] | None = None,
) -> GroupedChunk:
    """`group_chunk` over a scored chunk (the pipeline's group step), carrying its inference time along."""
    grouped = group_chunk(
        env, chunk.items, chunk.rollouts, group_size=group_size, max_token_length=max_token_length,
        ensure_scores_are_not_same=ensure_scores_are_not_same, run_id=run_id, seed=seed,
        generation_params=generation_params,
    )
    grouped.generate_s, grouped.generate_started_at = chunk.generate_s, chunk.started_at
    grouped.worker = getattr(chunk, "worker", {})
    return grouped
