"""Blackjack, multi-step: the model hits or stands each turn; the reward is the hand's outcome.

The env's own rules (no gymnasium needed): one seeded shuffled deck per item, so every rollout of a group
plays the same cards and differs only in its decisions; aces count 11 or 1, the dealer draws to 17 and stands
on all 17s, a two-card 21 is a natural. Each turn the model replies `<action>hit</action>` or
`<action>stand</action>`; after a hit the environment says which card came and the new total. The episode
ends on stand, bust, a reply without a valid action, or `max_turns`. Every step's messages are kept in the
group. Reward (replayed from the conversation, a pure function): `win_reward` (1.0; a natural pays 1.5),
0 for a push, -1.0 for a loss, and `invalid_reward` (-1.0) when a reply has no valid action.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from environments.base import BaseEnv, EnvConfig, Item
from environments.episode import Episode

RANKS = ["A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K"]
_ACTION = re.compile(r"<action>\s*(hit|stand)\s*</action>", re.IGNORECASE)
SYSTEM_PROMPT = "You play blackjack against the dealer. Each turn reply <action>hit</action> or <action>stand</action>."


class BlackjackConfig(EnvConfig):
    """The `env.` section for Blackjack."""

    max_turns: int = Field(6, ge=1, description="Most decisions per hand.")
    win_reward: float = Field(1.0, description="Reward for winning a hand (a natural pays 1.5x).")
    invalid_reward: float = Field(-1.0, description="Reward when a reply has no valid <action>.")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message with the rules of the reply.")
    max_tokens: int = Field(24, ge=1, description="Most new tokens per decision.")


def total(cards: list[str]) -> int:
    """Best blackjack total: aces count 11 unless that busts."""
    value = sum(11 if c == "A" else 10 if c in "JQK" or c == "10" else int(c) for c in cards)
    aces = cards.count("A")
    while value > 21 and aces:
        value, aces = value - 10, aces - 1
    return value


def deal(seed: str) -> list[str]:
    deck = RANKS * 4
    random.Random(seed).shuffle(deck)
    return deck


def parse_action(reply: str) -> str | None:
    found = _ACTION.findall(reply)
    return found[-1].lower() if found else None


def play_out(deck: list[str], actions: list[str | None]) -> tuple[str, list[str], list[str]]:
    """Replay a hand: (outcome, player cards, dealer cards); outcome is win, natural, push, loss or invalid."""
    player, dealer, rest = [deck[0], deck[2]], [deck[1], deck[3]], iter(deck[4:])
    if total(player) == 21:
        return ("push" if total(dealer) == 21 else "natural"), player, dealer
    for action in actions:
        if action is None:
            return "invalid", player, dealer
        if action == "stand":
            break
        player.append(next(rest))
        if total(player) > 21:
            return "loss", player, dealer
    while total(dealer) < 17:
        dealer.append(next(rest))
    mine, theirs = total(player), total(dealer)
    return ("win" if theirs > 21 or mine > theirs else "push" if mine == theirs else "loss"), player, dealer


class BlackjackEnv(BaseEnv):
    name = "blackjack"
    config_cls = BlackjackConfig
    multi_turn = True
    scoring = "inline"  # a replay of a few cards
    config: BlackjackConfig

    def get_item(self, index: int) -> Item:
        deck = deal(f"{self.config.seed}:{index}")
        player = [deck[0], deck[2]]
        prompt = (f"Your cards: {' '.join(player)} (total {total(player)}). Dealer shows {deck[1]}. "
                  "Hit or stand?")
        return Item(key=f"blackjack:{self.config.seed}:{index}", messages=self.chat(prompt), answer=deck)

    async def play(self, item: Item, episode: Episode) -> None:
        deck = item.answer
        player = [deck[0], deck[2]]
        for _ in range(self.config.max_turns):
            action = parse_action(await episode.model_turn())
            if action != "hit" or total(player) == 21:  # stand, no valid action, or a natural: the hand is decided
                return
            player.append(deck[2 + len(player)])  # the player's draws are deck[4], deck[5], ...
            if total(player) > 21 or episode.out_of_room(48):
                return
            episode.add({"role": "user", "content": f"You drew {player[-1]}: total {total(player)}. Hit or stand?"})

    def score(self, item: Item, completion: Any) -> float:
        replies = [m["content"] for m in completion if m["role"] == "assistant"] if isinstance(completion, list) \
            else [completion]
        outcome, _, _ = play_out(item.answer, [parse_action(r) for r in replies])
        return {"natural": 1.5 * self.config.win_reward, "win": self.config.win_reward, "push": 0.0,
                "loss": -1.0, "invalid": self.config.invalid_reward}[outcome]

    def is_correct(self, item: Item, completion: Any) -> bool:
        return self.score(item, completion) > 0


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.blackjack:BlackjackEnv"))
