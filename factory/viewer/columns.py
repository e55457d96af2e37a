"""The run index as flat numpy columns: what filters, facets and plots scan (a million groups in milliseconds).

Strings (env, task family) are small integer codes; a missing difficulty is
-1; per-completion scores and lengths are flat arrays with the position of
their group beside them, so a filter's mask selects completions by fancy
indexing instead of exploding lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from factory.viewer.query import Filters

_ARRAYS = ("shard", "row", "env", "family", "difficulty", "policy_version", "score_mean", "created_s", "scores",
           "lengths", "first", "group_size")
PLOT_GROUPS = 100_000
"""Per-completion histograms of more groups than this use this many, taken evenly over them (and say so)."""


class Codes:
    """A growing string -> small int dictionary shared by all shards of a run."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}

    def encode(self, series: pl.Series) -> np.ndarray:
        for value in series.unique().to_list():
            if value not in self.ids:
                self.ids[value] = len(self.names)
                self.names.append(value)
        return series.replace_strict(self.ids, return_dtype=pl.Int32).to_numpy()


@dataclass
class ShardColumns:
    """One shard's columns, made when the shard is indexed."""

    env: np.ndarray
    family: np.ndarray
    difficulty: np.ndarray
    policy_version: np.ndarray
    score_mean: np.ndarray
    created_s: np.ndarray
    group_size: np.ndarray
    scores: np.ndarray
    lengths: np.ndarray


def shard_columns(frame: pl.DataFrame, envs: Codes, families: Codes) -> ShardColumns:
    return ShardColumns(
        env=envs.encode(frame["env"]),
        family=families.encode(frame["family"]),
        difficulty=frame["difficulty"].fill_null(-1).cast(pl.Int32).to_numpy(),
        policy_version=frame["policy_version"].cast(pl.Int64).to_numpy(),
        score_mean=frame["score_mean"].fill_null(float("nan")).cast(pl.Float64).to_numpy(),
        created_s=(frame["created_at"].dt.epoch("ms").cast(pl.Float64) / 1000.0).to_numpy(),
        group_size=frame["group_size"].cast(pl.Int64).to_numpy(),
        scores=frame["scores"].explode().drop_nulls().cast(pl.Float64).to_numpy(),
        lengths=frame["lengths"].explode().drop_nulls().cast(pl.Int32).to_numpy(),
    )


def split_columns(frame: pl.DataFrame, sizes: list[int], envs: Codes, families: Codes) -> list[ShardColumns]:
    """`shard_columns` of consecutive pieces of `frame` of `sizes` rows each (the shards of one row group of a
    compacted file), made once for the whole frame and sliced: a few polars calls per row group, not per shard."""
    whole = shard_columns(frame, envs, families)
    scores_per_group = frame["scores"].list.len().fill_null(0).to_numpy().astype(np.int64)
    lengths_per_group = frame["lengths"].list.len().fill_null(0).to_numpy().astype(np.int64)
    if scores_per_group.sum() != len(whole.scores) or lengths_per_group.sum() != len(whole.lengths):
        # null or empty lists (explode/drop_nulls counts them otherwise): slice the frame instead
        pieces, start = [], 0
        for size in sizes:
            pieces.append(shard_columns(frame.slice(start, size), envs, families))
            start += size
        return pieces
    group_ends = np.cumsum(sizes)
    score_ends = np.concatenate([[0], np.cumsum(scores_per_group)])[group_ends]
    length_ends = np.concatenate([[0], np.cumsum(lengths_per_group)])[group_ends]
    pieces, group, score, length = [], 0, 0, 0
    for end, score_end, length_end in zip(group_ends.tolist(), score_ends.tolist(), length_ends.tolist()):
        rows = slice(group, end)
        pieces.append(ShardColumns(
            env=whole.env[rows], family=whole.family[rows], difficulty=whole.difficulty[rows],
            policy_version=whole.policy_version[rows], score_mean=whole.score_mean[rows],
            created_s=whole.created_s[rows], group_size=whole.group_size[rows],
            scores=whole.scores[score:score_end], lengths=whole.lengths[length:length_end]))
        group, score, length = end, score_end, length_end
    return pieces


@dataclass
class Columns:
    """All indexed groups of a run, in commit order (position i is the i-th group)."""

    shard: np.ndarray
    row: np.ndarray
    env: np.ndarray
    family: np.ndarray
    difficulty: np.ndarray
    policy_version: np.ndarray
    score_mean: np.ndarray
    created_s: np.ndarray
    scores: np.ndarray
    lengths: np.ndarray
    first: np.ndarray
    """Where each group's completions start in `scores` and `lengths`."""
    group_size: np.ndarray
    env_names: list[str]
    family_names: list[str]

    def __post_init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    @property
    def size(self) -> int:
        return len(self.shard)

    @classmethod
    def concat(cls, parts: list[tuple[int, ShardColumns]], envs: Codes, families: Codes) -> Columns:
        """Columns of (shard id, shard columns) pairs, in the order given."""
        def cat(name: str, dtype: type) -> np.ndarray:
            arrays = [getattr(part, name) for _, part in parts]
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)

        sizes = [len(part.env) for _, part in parts]
        ids = np.array([shard_id for shard_id, _ in parts], dtype=np.int64)
        shard = np.repeat(ids, sizes) if parts else np.zeros(0, np.int64)
        row = np.concatenate([np.arange(n) for n in sizes]) if parts else np.zeros(0, np.int64)
        group_size = cat("group_size", np.int64)
        columns = cls(
            shard=shard, row=row, env=cat("env", np.int32), family=cat("family", np.int32),
            difficulty=cat("difficulty", np.int32), policy_version=cat("policy_version", np.int64),
            score_mean=cat("score_mean", np.float64), created_s=cat("created_s", np.float64),
            scores=cat("scores", np.float64), lengths=cat("lengths", np.int32),
            first=(np.cumsum(group_size) - group_size).astype(np.int64),
            group_size=group_size,
            env_names=list(envs.names), family_names=list(families.names),
        )
        return columns

    def with_capacity(self, factor: float = 1.25) -> Columns:
        """The same columns as views of buffers with room to grow, so a live run's next shards append in place."""
        result = Columns(**{name: getattr(self, name) for name in _ARRAYS}, env_names=self.env_names,
                         family_names=self.family_names)
        for name in _ARRAYS:
            values = getattr(self, name)
            buffer = np.empty(int(len(values) * factor) + 1024, dtype=values.dtype)
            buffer[: len(values)] = values
            result._buffers[name] = buffer
            result._buffers[name + ".filled"] = np.array([len(values)], dtype=np.int64)
            setattr(result, name, buffer[: len(values)])
        return result

    def append(self, more: Columns) -> Columns:
        """These columns followed by `more` (new shards of a live run), in amortised O(len(more)).

        Arrays are views of buffers with spare capacity (doubling as they
        fill): appending writes past the end of the buffer, which the views
        held by earlier `Columns` (and the requests still using them) never
        see. Only the newest `Columns` of a buffer may append in place.
        """
        joined = {}
        for name in _ARRAYS:
            old, new = getattr(self, name), getattr(more, name)
            if name == "first":
                new = new + len(self.scores)
            joined[name] = _extend(self._buffers, name, old, new)
        result = Columns(**joined, env_names=more.env_names, family_names=more.family_names)
        result._buffers = self._buffers
        return result

    def mask(self, filters: Filters) -> np.ndarray | None:
        """Which groups pass the index-side filters (everything but text); None when nothing filters."""
        mask = None

        def narrow(condition: np.ndarray) -> None:
            nonlocal mask
            mask = condition if mask is None else mask & condition

        if filters.env is not None:
            code = self.env_names.index(filters.env) if filters.env in self.env_names else -2
            narrow(self.env == code)
        if filters.family is not None:
            code = self.family_names.index(filters.family) if filters.family in self.family_names else -2
            narrow(self.family == code)
        if filters.difficulty is not None:
            narrow(self.difficulty == filters.difficulty)
        if filters.policy_version is not None:
            narrow(self.policy_version == filters.policy_version)
        if filters.score_min is not None:
            narrow(self.score_mean >= filters.score_min)
        if filters.score_max is not None:
            narrow(self.score_mean <= filters.score_max)
        return mask

    def completions(self, positions: np.ndarray | None, most: int = PLOT_GROUPS) -> tuple[np.ndarray, int]:
        """Indexes into `scores`/`lengths` of the completions of these groups (None: all), from at most `most`
        groups taken evenly over them; returns (indexes, groups used)."""
        if positions is None:
            positions = np.arange(self.size)
        if len(positions) > most:
            positions = positions[np.linspace(0, len(positions) - 1, most).astype(np.int64)]
        sizes = self.group_size[positions]
        total = int(sizes.sum())
        starts = np.repeat(self.first[positions] - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        return starts + np.arange(total), len(positions)

    def counts(self, name: str) -> list[tuple[object, int]]:
        """(value, groups) for env, family, difficulty or policy_version, sorted by value."""
        values = getattr(self, name)
        if name in ("env", "family"):
            names = self.env_names if name == "env" else self.family_names
            counts = np.bincount(values, minlength=len(names)) if len(values) else np.zeros(len(names), int)
            return sorted((names[code], int(n)) for code, n in enumerate(counts) if n)
        present = values[values >= 0] if name == "difficulty" else values
        if len(present) == 0:
            return []
        low, high = int(present.min()), int(present.max())
        if high - low < 1_000_000:  # small integer range: bincount, not a sort
            counts = np.bincount(present - low, minlength=high - low + 1)
            return [(low + value, int(n)) for value, n in enumerate(counts) if n]
        uniques, counts = np.unique(present, return_counts=True)
        return [(int(u), int(n)) for u, n in zip(uniques, counts)]


def _extend(buffers: dict[str, np.ndarray], name: str, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """`old` + `new` as a view of buffers[name], written in place when `old` ends where the buffer is filled."""
    buffer = buffers.get(name)
    size = len(old) + len(new)
    fits = (buffer is not None and len(old) and np.shares_memory(buffer, old) and old.base is buffer
            and buffers.get(name + ".filled") is not None and int(buffers[name + ".filled"][0]) == len(old)
            and size <= len(buffer))
    if not fits:
        buffer = np.empty(max(size * 2, 1024), dtype=old.dtype)
        buffer[: len(old)] = old
        buffers[name] = buffer
        buffers[name + ".filled"] = np.zeros(1, dtype=np.int64)
    buffer[len(old): size] = new
    buffers[name + ".filled"][0] = size
    return buffer[:size]


def histogram(values: np.ndarray, bins: int = 20) -> tuple[list[int], list[float]]:
    """Counts and edges of `bins` equal bins over the values' range (bincount: ~10x faster than np.histogram)."""
    low, high = float(values.min()), float(values.max())
    if high <= low:
        high = low + 1.0
    which = np.minimum(((values - low) * (bins / (high - low))).astype(np.int64), bins - 1)
    counts = np.bincount(which, minlength=bins)
    return counts.tolist(), np.linspace(low, high, bins + 1).tolist()
