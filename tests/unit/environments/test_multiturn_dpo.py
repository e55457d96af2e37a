"""DPO pairs from multi-turn episodes (Blackjack, tool calling): one shared history, then two different model turns.

Episodes are played on the starter policy's real tokenizer with scripted replies, grouped as datagen groups
them, committed to a shard store and exported as the DPO CLI would.
"""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq

from environments.blackjack import BlackjackConfig, BlackjackEnv, play_out, total
from environments.tool_calling import ToolCallingConfig, ToolCallingEnv
from factory.export import DpoExportConfig, DpoSelectionConfig, OutputConfig, SourceConfig, export_dpo
from factory.export.config import OutputConfig as Output
from factory.export.render import DIVERGED_AT_ENV_TURN, IDENTICAL, Renderer, split_at_divergence
from factory.export.select import Pair
from factory.export.source import group_from_wire
from factory.store import ShardStore
from tasks.group import build_group
from tests.unit.environments.scripted import ScriptedSampler

HIT, STAND = "<action>hit</action>", "<action>stand</action>"


def _group(env, item, plans, tokenizer, scores=None):
    """Play one scripted episode per plan and group them as the datagen flow does."""
    rollouts = []
    for plan in plans:
        rollout = asyncio.run(env.run_episode(item, ScriptedSampler(tokenizer, plan), env.sampling()))
        rollout.score = env.score(item, rollout.scoring_input())
        rollouts.append(rollout)
    if scores is not None:
        for rollout, score in zip(rollouts, scores):
            rollout.score = score
    group = build_group(env.name, item, rollouts, group_size=len(plans), max_token_length=4096, run_id="dpo")
    assert not isinstance(group, str), group
    return group


def _export(tmp_path, groups, **output):
    store = ShardStore(tmp_path / "store")
    store.commit("dpo", "w0", 0, groups)
    config = DpoExportConfig(source=SourceConfig(store=str(store.root)), select=DpoSelectionConfig(pairs_per_group=4),
                             output=OutputConfig(path=str(tmp_path / "dpo.parquet"), **output))
    stats = export_dpo(config)
    return stats, pq.read_table(tmp_path / "dpo.parquet").to_pylist()


def _assert_pairs_follow_their_own_history(rows, groups):
    conversations = [c for g in groups for c in g.messages]
    for row in rows:
        assert row["chosen"] != row["rejected"]
        assert all(m["role"] == "assistant" for m in row["chosen"] + row["rejected"])
        # both sides continue the shared prompt in a conversation that really happened
        for side in ("chosen", "rejected"):
            assert any(c[: len(row["prompt"]) + len(row[side])] == row["prompt"] + row[side] for c in conversations)
        assert row["score_chosen"] > row["score_rejected"]


def _blackjack_item(env):
    """A hand where hit-then-stand is still alive (no bust on the first draw) and the plans' outcomes differ."""
    for i in range(500):
        item = env.get_item(i)
        deck = item.answer
        if total([deck[0], deck[2]]) < 21 and total([deck[0], deck[2], deck[4]]) <= 21:
            outcomes = {play_out(deck, plan)[0] for plan in (["stand"], ["hit", "stand"], ["hit", "hit"])}
            if len(outcomes) == 3:
                return item
    raise AssertionError("no suitable hand in 500")


def test_blackjack_pairs_share_the_history_up_to_the_first_different_decision(tokenizer, tmp_path):
    env = BlackjackEnv(BlackjackConfig(max_turns=3))
    item = _blackjack_item(env)
    plans = [[STAND], [HIT, STAND], [HIT, HIT, STAND], [STAND]]
    group = _group(env, item, plans, tokenizer)
    stats, rows = _export(tmp_path, [group])
    assert rows and stats.rows_out == len(rows)
    _assert_pairs_follow_their_own_history(rows, [group])
    for row in rows:
        decisions = {row["chosen"][0]["content"], row["rejected"][0]["content"]}
        assert decisions == {HIT, STAND}  # the turn where the two hands parted
        if row["prompt"][-1]["content"].startswith("You drew"):  # parted on the second decision: the hit is shared
            assert row["prompt"][2] == {"role": "assistant", "content": HIT}


def test_identical_episodes_with_different_scores_are_dropped_and_counted(tokenizer, tmp_path):
    env = BlackjackEnv(BlackjackConfig(max_turns=3))
    item = _blackjack_item(env)
    # the same play scored differently (a noisy scorer such as an LLM judge): nothing to prefer
    group = _group(env, item, [[STAND], [STAND]], tokenizer, scores=[1.0, -1.0])
    stats, rows = _export(tmp_path, [group])
    assert rows == [] and stats.dropped[IDENTICAL] == 2


def _tool_item(env):
    item = next(env.get_item(i) for i in range(200) if len(env.get_item(i).info["basket"]) == 2)
    (a, n), (b, m) = item.info["basket"].items()
    return item, a, b, n, m


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_calling_pairs_and_text_rendering(tokenizer, tmp_path):
    env = ToolCallingEnv(ToolCallingConfig(max_goods=2, max_turns=5))
    item, a, b, n, m = _tool_item(env)
    prices = item.info["prices"]
    expression = f"{prices[a]}*{n}+{prices[b]}*{m}"
    right = [_call("price", good=a), _call("price", good=b), _call("calculator", expression=expression),
             f"<answer>{item.answer}</answer>"]
    wrong_sum = right[:2] + [_call("calculator", expression=f"{prices[a]}+{prices[b]}"), "<answer>7</answer>"]
    guess = [_call("price", good=a), f"<answer>{item.answer + 1}</answer>"]
    group = _group(env, item, [right, wrong_sum, guess], tokenizer)
    assert group.scores[0] > group.scores[1] and group.scores[0] > group.scores[2]
    assert [m["role"] for m in group.messages[0]].count("assistant") == 4  # a real multi-turn episode
    stats, rows = _export(tmp_path, [group])
    assert rows and stats.rows_out == len(rows)
    _assert_pairs_follow_their_own_history(rows, [group])
    wire = group_from_wire(group.model_dump())
    renderer = Renderer("dpo", Output(path="x"))
    # vs the wrong sum: both looked both prices up; they part at the calculator call
    row = renderer.dpo_row(wire, Pair(0, 1))
    assert row["chosen"] == [{"role": "assistant", "content": right[2]}]
    assert row["rejected"] == [{"role": "assistant", "content": wrong_sum[2]}]
    assert [x["role"] for x in row["prompt"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    # vs the guess: they share the first lookup and its result, then part
    row = renderer.dpo_row(wire, Pair(0, 2))
    assert row["chosen"][0]["content"] == right[1] and row["rejected"][0]["content"] == guess[1]
    assert row["prompt"][-1]["role"] == "tool"

    # text style with the chat template: the prompt is the shared history, rendered once, up to the parting turn
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    renderer = Renderer("dpo", Output(path="x", style="text", tokenizer=str(tok_dir)), tokenizer)
    text = renderer.dpo_row(wire, Pair(0, 2))
    assert text["prompt"].endswith("<|im_start|>assistant\n") and "<tool_response>" in text["prompt"]
    assert text["chosen"].startswith(right[1]) and text["rejected"].startswith(guess[1])


def test_token_only_groups_pair_at_the_first_different_trained_run(tokenizer, tmp_path):
    env = BlackjackEnv(BlackjackConfig(max_turns=3))
    item = _blackjack_item(env)
    group = _group(env, item, [[HIT, STAND], [HIT, HIT, STAND]], tokenizer)
    wire = group_from_wire({**group.model_dump(), "messages": None})
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    renderer = Renderer("dpo", Output(path="x", style="text", tokenizer=str(tok_dir)), tokenizer)
    row = renderer.dpo_row(wire, Pair(0, 1))
    assert row["prompt"].count(HIT) == 2 and row["prompt"].rstrip().endswith("<|im_start|>assistant")
    assert row["chosen"].startswith(STAND) and row["rejected"].startswith(HIT)
    same = group_from_wire({**group.model_dump(), "messages": None, "tokens": [group.tokens[0]] * 2,
                            "masks": [group.masks[0]] * 2})
    assert renderer.dpo_row(same, Pair(0, 1)) is None and renderer.drop_reason == IDENTICAL


def test_split_at_divergence_rules():
    user = {"role": "user", "content": "q"}
    a, b = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}
    tool = {"role": "tool", "content": "r"}
    assert split_at_divergence([user, a, tool, a], [user, a, tool, b]) == ([user, a, tool], [a], [b])
    assert split_at_divergence([user, a], [user, a]) == IDENTICAL
    assert split_at_divergence([user, a, tool], [user, a, {"role": "tool", "content": "other"}]) == DIVERGED_AT_ENV_TURN
    assert split_at_divergence([user, a], [user, a, tool, b]) == DIVERGED_AT_ENV_TURN
    assert split_at_divergence([user, a, b], [user, a]) == ([user], [a, b], [a])  # a turn of two messages vs one
    assert split_at_divergence([user, a, tool], [user, a]) == DIVERGED_AT_ENV_TURN  # one side stopped
