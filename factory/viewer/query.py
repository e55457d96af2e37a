"""What a page asks of a run: the filters, parsed from the URL query."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Filters:
    """What the groups list is narrowed to; None means any. Scores filter the group's mean score."""

    env: str | None = None
    family: str | None = None
    difficulty: int | None = None
    policy_version: int | None = None
    score_min: float | None = None
    score_max: float | None = None
    text: str | None = None

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> Filters:
        """Filters from URL query parameters; empty values mean any, a bad number raises naming the parameter."""
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = (params.get(spec.name) or "").strip()
            if not raw:
                continue
            kind = {"difficulty": int, "policy_version": int, "score_min": float, "score_max": float}.get(spec.name, str)
            try:
                values[spec.name] = kind(raw)
            except ValueError:
                raise ValueError(f"filter {spec.name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
        return cls(**values)

    def as_query(self) -> dict[str, str]:
        return {spec.name: str(value) for spec in fields(self) if (value := getattr(self, spec.name)) is not None}
