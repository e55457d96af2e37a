"""An adaptive difficulty curriculum per task family, fed by the pass rates of the groups a run scores.

For environments whose items have a difficulty knob (InternBootcamp: 14
families, levels 1-5), each family has a level. After every committed chunk
the controller looks at the family's recent items *at its current level*: when
their pass rate (share of rollouts that solved the item) rises above
`high`, the level goes up one step; below `low`, it goes down one step; at
the ends of the level range it stays. With `reweight`, a family's draw weight
is its base weight times the share of its recent items that gave a kept group
(floored at `min_weight`), so the mix favours the families still learnable.

The controller is a pure function of the outcomes it is given, in order, so
replaying the committed chunks of a run rebuilds exactly the state an
uninterrupted run had (`factory/sampling.py` does that on resume). Its state
round-trips through JSON (`to_dict` / `from_dict`) with no float drift: the
window holds integer (passed, rollouts) pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, model_validator

from factory.config import FactoryConfig


class CurriculumSettings(FactoryConfig):
    """The `datagen.curriculum.` section: adaptive difficulty per family (envs with a difficulty knob only)."""

    enabled: bool = Field(False, description="Move each family's difficulty level to keep its pass rate in [low, high].")
    low: float = Field(0.2, ge=0.0, le=1.0, description="Below this recent pass rate a family's level goes down.")
    high: float = Field(0.8, ge=0.0, le=1.0, description="Above this recent pass rate a family's level goes up.")
    window_items: int = Field(12, ge=1, description="Recent items (at the current level) a family's pass rate is taken over.")
    min_items: int = Field(4, ge=1, description="Items a family needs at its level before the level may move.")
    start_level: int | None = Field(None, description="Every family's first level; default: the lowest of env.difficulties.")
    reweight: bool = Field(False, description="Weigh families by the share of their recent items that gave a kept group.")
    min_weight: float = Field(0.1, gt=0.0, le=1.0, description="Floor of a family's weight factor when reweighting.")

    @model_validator(mode="after")
    def _band(self) -> CurriculumSettings:
        if self.low > self.high:
            raise ValueError(f"curriculum band is empty: low {self.low} > high {self.high}")
        if self.min_items > self.window_items:
            raise ValueError(f"min_items {self.min_items} exceeds window_items {self.window_items}")
        return self


@dataclass(frozen=True)
class ItemOutcome:
    """What one scored item tells the curriculum: its family and level, rollouts that passed, and if it was kept."""

    family: str
    level: int
    passed: int
    rollouts: int
    kept: bool

    def to_list(self) -> list[Any]:
        return [self.family, self.level, self.passed, self.rollouts, int(self.kept)]

    @classmethod
    def from_list(cls, row: Sequence[Any]) -> ItemOutcome:
        family, level, passed, rollouts, kept = row
        return cls(str(family), int(level), int(passed), int(rollouts), bool(kept))


@dataclass
class FamilyState:
    """One family: its level, totals over the run, and the recent window at the current level."""

    level: int
    items: int = 0
    rollouts: int = 0
    passed: int = 0
    groups_kept: int = 0
    window: list[list[int]] = field(default_factory=list)
    """[passed, rollouts, kept] of the most recent items drawn at the current level (oldest first)."""
    moves: int = 0

    def pass_rate(self) -> float | None:
        """Recent pass rate at the current level (None before any item)."""
        rollouts = sum(r for _, r, _ in self.window)
        return sum(p for p, _, _ in self.window) / rollouts if rollouts else None

    def kept_share(self) -> float | None:
        return sum(k for _, _, k in self.window) / len(self.window) if self.window else None


class Curriculum:
    """Per-family levels and weights, moved by recent pass rates; deterministic given the outcomes applied."""

    def __init__(self, settings: CurriculumSettings, families: Sequence[str], *, levels: tuple[int, int] = (1, 5),
                 start_level: int | None = None, base_weights: Mapping[str, float] | None = None) -> None:
        if not families:
            raise ValueError("a curriculum needs at least one task family")
        self.settings = settings
        self.min_level, self.max_level = levels
        first = settings.start_level if settings.start_level is not None else (start_level or self.min_level)
        if not self.min_level <= first <= self.max_level:
            raise ValueError(f"curriculum start level {first} is outside {self.min_level}..{self.max_level}")
        self.base_weights = {f: float((base_weights or {}).get(f, 1.0)) for f in families}
        self.families: dict[str, FamilyState] = {f: FamilyState(level=first) for f in families}
        self.chunks_applied = 0
        self.last_chunk: int | None = None
        self.history: list[dict[str, Any]] = []
        """Level moves: {"chunk", "family", "from", "to", "pass_rate"}."""

    # ---- what the next items are drawn with ----
    def levels(self) -> dict[str, int]:
        return {f: s.level for f, s in self.families.items()}

    def weights(self) -> dict[str, float]:
        if not self.settings.reweight:
            return dict(self.base_weights)
        out = {}
        for name, state in self.families.items():
            share = state.kept_share()
            factor = 1.0 if share is None else max(self.settings.min_weight, share)
            out[name] = self.base_weights[name] * factor
        return out

    def plan(self) -> dict[str, Any]:
        """The item plan for a chunk: a level and a draw weight per family (what `BaseEnv.get_planned_item` takes)."""
        return {"levels": self.levels(), "weights": self.weights()}

    # ---- learning from scored items ----
    def apply(self, chunk: int, outcomes: Iterable[ItemOutcome], groups_kept: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
        """Take one committed chunk's outcomes (in item order); return the level moves it caused."""
        touched: list[str] = []
        for outcome in outcomes:
            state = self.families.get(outcome.family)
            if state is None:
                continue  # a family outside the curriculum (e.g. weights changed on resume)
            state.items += 1
            state.rollouts += outcome.rollouts
            state.passed += outcome.passed
            if outcome.level == state.level and outcome.rollouts > 0:
                # Items drawn before the last move (the pipeline lags a chunk or two) say nothing about this level.
                state.window.append([outcome.passed, outcome.rollouts, int(outcome.kept)])
                del state.window[: -self.settings.window_items]
            if outcome.family not in touched:
                touched.append(outcome.family)
        for name, kept in (groups_kept or {}).items():
            if name in self.families:
                self.families[name].groups_kept += int(kept)
        moves = []
        for name in touched:
            state = self.families[name]
            rate = state.pass_rate()
            if rate is None or len(state.window) < self.settings.min_items:
                continue
            step = 1 if rate > self.settings.high else -1 if rate < self.settings.low else 0
            new = min(self.max_level, max(self.min_level, state.level + step))
            if new != state.level:
                moves.append({"chunk": chunk, "family": name, "from": state.level, "to": new, "pass_rate": round(rate, 4)})
                state.level, state.window = new, []
                state.moves += 1
        self.history.extend(moves)
        self.chunks_applied += 1
        self.last_chunk = chunk
        return moves

    # ---- persistence and display ----
    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.model_dump(mode="json"),
            "levels": [self.min_level, self.max_level],
            "base_weights": self.base_weights,
            "chunks_applied": self.chunks_applied,
            "last_chunk": self.last_chunk,
            "families": {name: {"level": s.level, "items": s.items, "rollouts": s.rollouts, "passed": s.passed,
                                "groups_kept": s.groups_kept, "window": s.window, "moves": s.moves,
                                "pass_rate": s.pass_rate(), "weight": self.weights()[name]}
                         for name, s in self.families.items()},
            "history": self.history,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Curriculum:
        settings = CurriculumSettings.model_validate(data["settings"])
        families = data["families"]
        made = cls(settings, list(families), levels=tuple(data["levels"]),  # type: ignore[arg-type]
                   start_level=None, base_weights=data["base_weights"])
        for name, saved in families.items():
            made.families[name] = FamilyState(level=saved["level"], items=saved["items"], rollouts=saved["rollouts"],
                                              passed=saved["passed"], groups_kept=saved["groups_kept"],
                                              window=[list(row) for row in saved["window"]], moves=saved["moves"])
        made.chunks_applied = data["chunks_applied"]
        made.last_chunk = data["last_chunk"]
        made.history = list(data["history"])
        return made

    def table(self) -> list[dict[str, Any]]:
        """One row per family, for the Prefect table artifact."""
        weights = self.weights()
        total = sum(weights.values()) or 1.0
        rows = []
        for name, s in self.families.items():
            rate = s.pass_rate()
            rows.append({"family": name, "level": s.level, "recent_pass_rate": None if rate is None else round(rate, 3),
                         "window_items": len(s.window), "items": s.items, "groups_kept": s.groups_kept,
                         "pass_rate_all": round(s.passed / s.rollouts, 3) if s.rollouts else None,
                         "mix_share": round(weights[name] / total, 3), "level_moves": s.moves})
        return rows
