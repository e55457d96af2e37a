"""Chess on python-chess: answer a move for a position, or play a few moves against a scripted opponent.

Positions come from seeded random play from the start (`min_plies`..`max_plies` random legal moves); with
`tactics: true` only positions where the best move is at least `tactic_margin` pawns better than the
second best by the shallow search below (a hanging piece to take, a mate in one) are kept, as puzzles
whose solution is that move. The model answers in SAN (`Nf3`) or UCI (`g1f3`) inside `<move></move>` (a bare
move as the whole reply is read too).

Scoring (`grade_move`, a pure function of the position and the reply): a reply with no move in it scores 0
with reason "unparseable"; a move that is not legal here scores 0 ("illegal"; "ambiguous" for SAN that
fits two pieces); a legal move scores `legal_reward + (1 - legal_reward) * quality`, where quality places
its search value between the worst (0) and the best (1) legal move, values clipped to +-10 pawns. The
search is a negamax over material (mate = 1000 pawns) to `search_depth` plies, so depth 2 sees a capture
and the recapture; its move values are cached per position, so a group costs one search.

`mode: play` is multi-turn: the model plays the side to move for `max_moves` moves; after each of its moves
the opponent (the same search at `opponent_depth`, ties broken by a seeded draw) answers, and the env
says which move it played and the new position's FEN. Reward: the mean score of the model's moves over
`max_moves` (an illegal or unparseable move ends the game; the moves it did not make count 0), and 1.0
when the model gives mate.

Needs the `chess` package (python-chess): pip install chess.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from environments.base import BaseEnv, EnvConfig, Item
from environments.episode import Episode

MATE = 1000.0
CLIP = 10.0
"""Move values are clipped to +-CLIP pawns when graded, so a missed mate does not flatten every other difference."""
PIECE_VALUES = {1: 1.0, 2: 3.0, 3: 3.0, 4: 5.0, 5: 9.0, 6: 0.0}  # pawn, knight, bishop, rook, queen, king
_TAG = re.compile(r"<move>(.*?)</move>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"^\d+\s*\.+\s*")
SYSTEM_PROMPT = ("You are a chess engine. Reply with one move for the side to move, in SAN (e.g. Nf3) or UCI "
                 "(e.g. g1f3), inside <move></move>.")


def _chess() -> Any:
    try:
        import chess
    except ImportError:
        raise ImportError("the chess env needs python-chess: pip install chess") from None
    return chess


class ChessConfig(EnvConfig):
    """The `env.` section for chess."""

    mode: Literal["move", "play"] = Field("move", description="move: answer one move per position; play: a game.")
    min_plies: int = Field(6, ge=0, description="Fewest random plies played from the start to reach a position.")
    max_plies: int = Field(40, ge=0, description="Most random plies played from the start to reach a position.")
    tactics: bool = Field(False, description="Keep only positions whose best move beats the rest by tactic_margin.")
    tactic_margin: float = Field(2.0, gt=0, description="Pawns the best move must be ahead of the second best.")
    search_depth: int = Field(2, ge=1, le=3, description="Plies of the negamax that values the model's move.")
    legal_reward: float = Field(0.2, ge=0.0, le=1.0, description="Score of the worst legal move (the best scores 1).")
    max_moves: int = Field(3, ge=1, description="play mode: the model's moves per game.")
    opponent_depth: int = Field(1, ge=1, le=3, description="play mode: plies the scripted opponent searches.")
    diagram: bool = Field(True, description="Also draw the first position as text (about 130 starter-policy tokens).")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="System message with the answer format.")
    max_tokens: int = Field(24, ge=1, description="Most new tokens per move.")

    @model_validator(mode="after")
    def _plies_range(self) -> ChessConfig:
        if self.min_plies > self.max_plies:
            raise ValueError(f"min_plies {self.min_plies} > max_plies {self.max_plies}; set min_plies <= max_plies")
        return self


@dataclass(frozen=True)
class MoveGrade:
    """A reply's move on a position: its score, why (ok, unparseable, illegal, ambiguous), and the move in UCI."""

    score: float
    reason: str
    move: str | None = None


def material(board: Any) -> float:
    """Material of the side to move minus the other side's, in pawns."""
    chess = _chess()
    value = 0.0
    for piece, worth in PIECE_VALUES.items():
        value += worth * (chess.popcount(board.pieces_mask(piece, board.turn))
                          - chess.popcount(board.pieces_mask(piece, not board.turn)))
    return value


def negamax(board: Any, depth: int) -> float:
    """Value of the position for the side to move: material at the leaves, mates and draws found on the way."""
    if depth == 0:
        return material(board)
    best = None
    for move in list(board.legal_moves):
        board.push(move)
        value = -negamax(board, depth - 1)
        board.pop()
        best = value if best is None or value > best else best
    if best is None:  # no legal move: mated (sooner is worse) or stalemate
        return -(MATE + depth) if board.is_check() else 0.0
    return best


@lru_cache(maxsize=4096)
def move_values(fen: str, depth: int) -> dict[str, float]:
    """Every legal move of the position (UCI) -> its negamax value to `depth` plies for the side to move."""
    board = _chess().Board(fen)
    values = {}
    for move in list(board.legal_moves):
        board.push(move)
        values[move.uci()] = -negamax(board, depth - 1)
        board.pop()
    return values


def parse_move(board: Any, reply: str) -> tuple[Any | None, str]:
    """(the move, "ok") or (None, reason): the last <move> tag's text (or the whole reply) as SAN or UCI."""
    chess = _chess()
    found = _TAG.findall(reply)
    text = (found[-1] if found else reply).strip()
    text = _NUMBER.sub("", text).strip().rstrip("!?").strip()
    if not text or len(text) > 12 or " " in text:
        return None, "unparseable"
    try:
        return board.parse_san(text), "ok"
    except chess.AmbiguousMoveError:
        return None, "ambiguous"
    except chess.IllegalMoveError:
        return None, "illegal"
    except ValueError:  # not SAN: maybe UCI
        pass
    try:
        move = chess.Move.from_uci(text.lower())
    except ValueError:
        return None, "unparseable"
    return (move, "ok") if move in board.legal_moves else (None, "illegal")


def grade_move(fen: str, reply: str, depth: int, legal_reward: float) -> MoveGrade:
    """Score of the move in `reply` on the position `fen` (see the module docstring)."""
    board = _chess().Board(fen)
    move, reason = parse_move(board, reply)
    if move is None:
        return MoveGrade(0.0, reason)
    values = {m: min(max(v, -CLIP), CLIP) for m, v in move_values(fen, depth).items()}
    best, worst = max(values.values()), min(values.values())
    quality = 1.0 if best == worst else (values[move.uci()] - worst) / (best - worst)
    return MoveGrade(legal_reward + (1.0 - legal_reward) * quality, "ok", move.uci())


def opponent_move(board: Any, depth: int, seed: str) -> Any:
    """The scripted opponent's move: one of the best by the search, drawn with a seed fixed by the position."""
    values = move_values(board.fen(), depth)
    best = max(values.values())
    choices = sorted(m for m, v in values.items() if v == best)
    return _chess().Move.from_uci(random.Random(f"{seed}:{board.fen()}").choice(choices))


def show(board: Any, diagram: bool = True) -> str:
    """The position as the model sees it: its FEN, optionally a text diagram, and the side to move."""
    side = "White" if board.turn else "Black"
    return f"FEN: {board.fen()}\n{board}\n{side} to move." if diagram else f"FEN: {board.fen()}\n{side} to move."


class ChessEnv(BaseEnv):
    name = "chess"
    config_cls = ChessConfig
    scoring = "inline"  # a cached shallow search per position; bounded by search_depth <= 3
    config: ChessConfig

    def __init__(self, config: ChessConfig | None = None) -> None:
        super().__init__(config)
        self.multi_turn = self.config.mode == "play"  # type: ignore[misc]  # play mode is a multi-turn episode

    def position(self, index: int) -> Any:
        """The position of item `index`: seeded random play, retried (same seed stream) until it fits."""
        chess, cfg = _chess(), self.config
        rng = random.Random(f"chess:{cfg.seed}:{index}")
        for _ in range(200):
            board = chess.Board()
            for _ in range(rng.randint(cfg.min_plies, cfg.max_plies)):
                moves = list(board.legal_moves)
                if not moves:
                    break
                board.push(rng.choice(moves))
            if board.is_game_over():
                continue
            if not cfg.tactics:
                return board
            values = sorted(move_values(board.fen(), cfg.search_depth).values(), reverse=True)
            if len(values) > 1 and values[0] - values[1] >= cfg.tactic_margin:
                return board
        raise ValueError(f"no position for item {index} in 200 tries; lower tactic_margin or widen the plies range")

    def get_item(self, index: int) -> Item:
        board = self.position(index)
        fen = board.fen()
        values = move_values(fen, self.config.search_depth)
        best = [m for m, v in values.items() if v == max(values.values())]
        board.clear_stack()
        return Item(key=f"chess:{self.config.mode}:{self.config.seed}:{index}",
                    messages=self.chat(show(board, self.config.diagram)), answer=fen, info={"best": sorted(best)})

    async def play(self, item: Item, episode: Episode) -> None:
        board = _chess().Board(item.answer)
        for turn in range(self.config.max_moves):
            move, _ = parse_move(board, await episode.model_turn())
            if move is None:
                return
            board.push(move)
            if board.is_game_over() or turn == self.config.max_moves - 1 or episode.out_of_room(96):
                return
            reply = opponent_move(board, self.config.opponent_depth, f"{self.config.seed}:{item.key}")
            san = board.san(reply)
            board.push(reply)
            if board.is_game_over():
                episode.add({"role": "user", "content": f"Opponent played {san}. Game over: {board.result()}."})
                return
            episode.add({"role": "user", "content": f"Opponent played {san}.\n{show(board, diagram=False)}"})

    def replay(self, item: Item, completion: Any) -> tuple[list[MoveGrade], bool]:
        """(the grade of each of the model's moves, whether it gave mate), replayed with the opponent's answers."""
        cfg = self.config
        replies = [m["content"] for m in completion if m["role"] == "assistant"] if isinstance(completion, list) \
            else [completion]
        board, grades = _chess().Board(item.answer), []
        for reply in replies[: cfg.max_moves if self.multi_turn else 1]:
            grade = grade_move(board.fen(), reply, cfg.search_depth, cfg.legal_reward)
            grades.append(grade)
            if grade.move is None:
                break
            board.push_uci(grade.move)
            if board.is_checkmate():
                return grades, True
            if board.is_game_over():
                break
            board.push(opponent_move(board, cfg.opponent_depth, f"{cfg.seed}:{item.key}"))
        return grades, False

    def score(self, item: Item, completion: Any) -> float:
        grades, mated = self.replay(item, completion)
        if not self.multi_turn:
            return grades[0].score if grades else 0.0
        return 1.0 if mated else sum(g.score for g in grades) / self.config.max_moves

    def is_correct(self, item: Item, completion: Any) -> bool:
        """Solved: every move the model made is one of the best by the search (and it made them all)."""
        grades, mated = self.replay(item, completion)
        complete = not self.multi_turn or mated or len(grades) == self.config.max_moves
        return bool(grades) and complete and all(g.score >= 1.0 for g in grades)

    def eval_metrics(self, items: list[Item], completions: list[Any]) -> dict[str, float]:
        metrics = super().eval_metrics(items, completions)
        reasons = [g.reason for i, c in zip(items, completions) for g in self.replay(i, c)[0][-1:]]
        for reason in ("unparseable", "illegal", "ambiguous"):
            metrics[f"rate/{reason}"] = reasons.count(reason) / max(len(reasons), 1)
        return metrics


if __name__ == "__main__":
    from flows.datagen import cli

    raise SystemExit(cli("environments.chess_env:ChessEnv"))
