"""Chess: positions fixed by seed, moves in SAN or UCI graded by legality and a shallow search, play mode."""

from __future__ import annotations

import asyncio

import chess
import pytest

from environments.base import Item
from environments.chess_env import ChessConfig, ChessEnv, grade_move, move_values, opponent_move, parse_move
from tests.unit.environments.scripted import ScriptedSampler

# 1. e4 e5 2. Bc4 Nc6 3. Qh5 Nf6: white mates with Qxf7#
SCHOLAR = "r1bqkb1r/pppp1ppp/2n2n2/4p2Q/2B1P3/8/PPPP1PPP/RNB1K1NR w KQkq - 4 4"


def test_positions_are_fixed_by_seed_and_index():
    env, again, other = ChessEnv(), ChessEnv(), ChessEnv(ChessConfig(seed=1))
    assert [env.get_item(i) for i in range(5)] == [again.get_item(i) for i in range(5)]
    assert [env.get_item(i).answer for i in range(5)] != [other.get_item(i).answer for i in range(5)]
    item = env.get_item(0)
    assert item.answer in item.messages[-1]["content"] and item.messages[0]["role"] == "system"
    assert not chess.Board(item.answer).is_game_over()


def test_tactics_positions_have_one_clearly_best_move():
    env = ChessEnv(ChessConfig(tactics=True, tactic_margin=2.0))
    for i in range(4):
        item = env.get_item(i)
        values = sorted(move_values(item.answer, 2).values(), reverse=True)
        assert values[0] - values[1] >= 2.0 and len(item.info["best"]) == 1
        assert env.score(item, f"<move>{item.info['best'][0]}</move>") == 1.0


def test_grades_san_uci_illegal_ambiguous_and_unparseable():
    assert grade_move(SCHOLAR, "<move>Qxf7#</move>", 2, 0.2).score == 1.0
    assert grade_move(SCHOLAR, "I play <move>h5f7</move>!", 2, 0.2).score == 1.0  # UCI
    assert grade_move(SCHOLAR, "Qxf7", 2, 0.2).score == 1.0                          # a bare move is read too
    assert grade_move(SCHOLAR, "<move>4. Qxf7#!!</move>", 2, 0.2).score == 1.0      # move number, annotation
    blunder = grade_move(SCHOLAR, "<move>a3</move>", 2, 0.2)  # leaves the queen to Nxh5
    retreat = grade_move(SCHOLAR, "<move>Qe2</move>", 2, 0.2)
    bishop = grade_move(SCHOLAR, "<move>Bxf7+</move>", 2, 0.2)  # a pawn, but no mate
    assert blunder.reason == retreat.reason == bishop.reason == "ok"
    assert blunder.score == 0.2 < retreat.score < bishop.score < 1.0
    for reply, reason in [("<move>e5</move>", "illegal"), ("<move>a1a8</move>", "illegal"),
                          ("I resign", "unparseable"), ("<move></move>", "unparseable"), ("", "unparseable"),
                          ("<move>Zz9</move>", "unparseable")]:
        grade = grade_move(SCHOLAR, reply, 2, 0.2)
        assert (grade.score, grade.reason) == (0.0, reason), reply
    # two knights can reach d2 after 1. d4 d5 2. Nf3 Nf6: "Nd2" is ambiguous, "Nbd2" is not
    board = chess.Board("rnbqkb1r/ppp1pppp/5n2/3p4/3P4/5N2/PPP1PPPP/RNBQKB1R w KQkq - 2 3")
    assert parse_move(board, "Nd2") == (None, "ambiguous")
    assert parse_move(board, "Nbd2")[0] == chess.Move.from_uci("b1d2")


def test_move_mode_scores_and_eval_metrics():
    env = ChessEnv()
    item = Item(key="scholar", messages=env.chat("x"), answer=SCHOLAR)
    assert env.score(item, "<move>Qxf7#</move>") == 1.0 and env.is_correct(item, "<move>Qxf7#</move>")
    assert env.score(item, "no idea") == 0.0 and not env.is_correct(item, "<move>a3</move>")
    metrics = env.eval_metrics([item] * 4, ["<move>Qxf7#</move>", "no idea", "<move>e5</move>", "<move>a3</move>"])
    assert metrics["accuracy"] == 0.25
    assert metrics["rate/unparseable"] == metrics["rate/illegal"] == 0.25


def test_play_mode_episode_against_the_scripted_opponent(tokenizer):
    env = ChessEnv(ChessConfig(mode="play", max_moves=3, group_size=1))
    assert env.multi_turn
    item = env.get_item(0)
    board, replies = chess.Board(item.answer), []
    for _ in range(3):  # the model plays the search's best moves; the opponent answers as the env will
        values = move_values(board.fen(), 2)
        move = max(sorted(values), key=values.get)
        replies.append(f"<move>{board.san(chess.Move.from_uci(move))}</move>")
        board.push_uci(move)
        if board.is_game_over():
            break
        board.push(opponent_move(board, 1, f"0:{item.key}"))
    [rollout] = asyncio.run(env.collect_trajectories(item, ScriptedSampler(tokenizer, list(replies))))
    roles = [m["role"] for m in rollout.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert rollout.messages[3]["content"].startswith("Opponent played ") and "FEN: " in rollout.messages[3]["content"]
    assert env.score(item, rollout.scoring_input()) == 1.0 and env.is_correct(item, rollout.scoring_input())
    # an unparseable first move ends the game at once and scores 0
    [bad] = asyncio.run(env.collect_trajectories(item, ScriptedSampler(tokenizer, ["let me think"])))
    assert [m["role"] for m in bad.messages].count("assistant") == 1 and env.score(item, bad.messages) == 0.0
    # one good move, then an illegal one: 1/3 of the game's moves
    mixed = [*item.messages, {"role": "assistant", "content": replies[0]}, {"role": "user", "content": "..."},
             {"role": "assistant", "content": "<move>a1a8</move>"}]
    assert env.score(item, mixed) == pytest.approx(1 / 3)


def test_play_mode_mate_scores_one():
    env = ChessEnv(ChessConfig(mode="play", max_moves=3))
    item = Item(key="scholar", messages=env.chat("x"), answer=SCHOLAR)
    assert env.score(item, [{"role": "assistant", "content": "<move>Qxf7#</move>"}]) == 1.0


def test_bad_config_names_the_fix():
    with pytest.raises(ValueError, match="min_plies <= max_plies"):
        ChessConfig(min_plies=10, max_plies=2)
