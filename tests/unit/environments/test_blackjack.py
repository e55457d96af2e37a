"""Blackjack: the rules, rewards for right/wrong/malformed play, and scripted multi-step episodes on real tokens."""

from __future__ import annotations

import asyncio

import pytest

from environments.blackjack import BlackjackConfig, BlackjackEnv, parse_action, play_out, total
from environments.groups import MASK_IGNORE
from tasks.group import sequence_tokens
from tests.unit.environments.scripted import ScriptedSampler

HIT, STAND = "<action>hit</action>", "<action>stand</action>"


def test_totals_and_actions():
    assert total(["A", "K"]) == 21 and total(["A", "A", "9"]) == 21 and total(["K", "Q", "2"]) == 22
    assert total(["A", "5", "K"]) == 16
    assert parse_action("I will <action> Stand </action>") == "stand" and parse_action("hit") is None


def test_replay_outcomes():
    #        p1    d1   p2   d2   then the cards drawn in order
    deck = ["10", "9", "7", "8", "5", "10"]
    assert play_out(deck, ["stand"])[0] == "push"                # 17 vs 17
    assert play_out(deck, ["hit", "stand"])[0] == "loss"         # 17 + 5 = 22: bust
    deck = ["10", "6", "8", "10", "9"]
    assert play_out(deck, ["stand"])[0] == "win"                 # dealer 16 draws 9: bust
    assert play_out(deck, ["hit"])[0] == "loss"                  # 18 + 9: bust
    assert play_out(deck, [None])[0] == "invalid"
    assert play_out(["A", "9", "K", "7", "5"], [])[0] == "natural"
    assert play_out(["A", "A", "K", "K"], ["stand"])[0] == "push"  # both naturals



def test_rewards_right_wrong_and_malformed():
    env = BlackjackEnv(BlackjackConfig())
    by_outcome = {}  # hands where a plan wins, loses or pushes, from the env's own decks
    for i in range(200):
        item = env.get_item(i)
        for actions in (["stand"], ["hit", "stand"]):
            by_outcome.setdefault(play_out(item.answer, actions)[0], (item, actions))
    assert {"win", "loss", "push"} <= set(by_outcome)
    for outcome, reward in (("win", 1.0), ("loss", -1.0), ("push", 0.0)):
        item, actions = by_outcome[outcome]
        replies = [{"role": "assistant", "content": f"<action>{a}</action>"} for a in actions]
        assert env.score(item, [*item.messages, *replies]) == reward
    item = next(env.get_item(i) for i in range(200) if play_out(env.get_item(i).answer, [])[0] != "natural")
    assert env.score(item, [*item.messages, {"role": "assistant", "content": "I'd like another card"}]) == -1.0


def test_scripted_episode_keeps_every_step_and_masks_only_the_model(tokenizer):
    env = BlackjackEnv(BlackjackConfig(group_size=1, max_turns=3))
    item = next(env.get_item(i) for i in range(100)  # a hand where hit, hit stays at 21 or less
                if total([env.get_item(i).answer[k] for k in (0, 2)]) < 21
                and total([env.get_item(i).answer[k] for k in (0, 2, 4, 5)]) <= 21)
    [rollout] = asyncio.run(env.collect_trajectories(item, ScriptedSampler(tokenizer, [HIT, HIT, STAND])))
    roles = [m["role"] for m in rollout.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert rollout.messages[3]["content"].startswith(f"You drew {item.answer[4]}")
    assert rollout.messages[5]["content"].startswith(f"You drew {item.answer[5]}")
    outcome = play_out(item.answer, ["hit", "hit", "stand"])[0]
    assert env.score(item, rollout.scoring_input()) == {"win": 1.0, "loss": -1.0, "push": 0.0}[outcome]
    tokens, masks, _ = sequence_tokens(rollout)
    trained = tokenizer.decode([t for t, m in zip(tokens, masks) if m != MASK_IGNORE])
    assert trained == HIT + "<|im_end|>" + HIT + "<|im_end|>" + STAND + "<|im_end|>"


@pytest.mark.parametrize("reply", ["whatever", STAND])
def test_episode_ends_on_stand_or_invalid(tokenizer, reply):
    env = BlackjackEnv(BlackjackConfig(group_size=1))
    [rollout] = asyncio.run(env.collect_trajectories(env.get_item(3), ScriptedSampler(tokenizer, [reply])))
    assert [m["role"] for m in rollout.messages].count("assistant") == 1
