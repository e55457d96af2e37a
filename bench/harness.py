"""Shared benchmark harness: interleaved side-by-side runs, median ratios, JSON lines, the command that made them.

A bench that compares implementations ("sides") hands each one to `compare` as a
callable that does the work once and returns its measurement (a number, or a
dict of named numbers such as {"groups/s": 812.0, "p50 ms": 3.1}). The harness
runs the sides interleaved in rounds (A, B, A, B, ... for `pairs` rounds, so
slow drift in machine load hits every side alike), takes each side's ratio to
the baseline *within the same round*, and reports the median ratio with its
spread (min and max over rounds). Every single measurement is appended as one
JSON line (value, round, machine load, cpu count, command) so a row of
bench/RESULTS.md can be checked or regenerated later with the printed command.

Typical bench:

    parser = argparse.ArgumentParser()
    add_bench_args(parser)                      # --smoke, --pairs, --json-out
    args = parser.parse_args()
    result = compare("datagen", [Side("raw", run_raw), Side("flow", run_flow)],
                     pairs=pairs_from(args), json_out=json_path("datagen", args))
    print_comparison(result)                   # markdown table + command + load

Benches without sides use `measure` (repeats of one callable, same JSON lines).
Benches that run flows use `prefect_server` (reuses PREFECT_API_URL's server
or starts one, and drains Prefect's log/event queues before it stops, so the
bench's process exits with its table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from factory.local_prefect import drain_prefect_workers, temporary_local_prefect

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
SMOKE_DIR = REPO / "bench" / "out" / "smoke"
DEFAULT_PAIRS = 3

Value = float | dict[str, float]


@dataclass(frozen=True)
class Side:
    """One implementation under test: `run()` does the work once and returns its metric(s)."""

    name: str
    run: Callable[[], Value]


@dataclass
class Comparison:
    """All measurements of one interleaved comparison; ratios are side / baseline within each round."""

    bench: str
    baseline: str
    sides: list[str]
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # side -> metric -> per round
    loads: list[tuple[float, float, float]] = field(default_factory=list)
    command: str = ""

    @property
    def metrics(self) -> list[str]:
        """Every metric any side measured, the baseline's first."""
        seen = dict.fromkeys(self.values[self.baseline])
        for side in self.sides:
            seen.update(dict.fromkeys(self.values[side]))
        return list(seen)

    def ratios(self, side: str, metric: str, versus: str | None = None) -> list[float]:
        """Per-round ratios side/baseline, or side/`versus` (rounds where that side measured 0 are skipped).

        A metric the baseline did not measure is compared with the baseline's first
        metric when both are in the same unit, the text before the first comma (e.g.
        "groups/s, pipeline only" against the raw loop's "groups/s"); a metric in another
        unit ("process CPU us/group") has no ratio (empty list).
        """
        base_values = self.values[versus or self.baseline]
        base_metric = metric if metric in base_values else next(iter(base_values))
        if metric.split(",")[0].strip() != base_metric.split(",")[0].strip():
            return []
        pairs = zip(self.values[side][metric], base_values[base_metric])
        return [value / base for value, base in pairs if base]

    def median_ratio(self, side: str, metric: str, versus: str | None = None) -> float:
        ratios = self.ratios(side, metric, versus)
        return statistics.median(ratios) if ratios else float("nan")

    def spread(self, side: str, metric: str, versus: str | None = None) -> tuple[float, float]:
        ratios = self.ratios(side, metric, versus) or [float("nan")]
        return min(ratios), max(ratios)

    def median(self, side: str, metric: str) -> float:
        return statistics.median(self.values[side][metric])


def machine() -> dict:
    """The machine's state now: load averages and cpu counts (the rest of the host was busy or not)."""
    load1, load5, load15 = os.getloadavg()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load1": round(load1, 2), "load5": round(load5, 2), "load15": round(load15, 2),
            "cpus": os.cpu_count(), "usable_cpus": usable, "host": socket.gethostname()}


def command_line(env_keys: Iterable[str] = ("ATROPOS_VENV", "OMP_NUM_THREADS")) -> str:
    """The shell command that reruns this bench as invoked: `python -m <module> <args>`, with relevant env vars."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = ["python", sys.argv[0]]
    env = [f"{key}={shlex.quote(os.environ[key])}" for key in env_keys if os.environ.get(key)]
    return " ".join(env + [shlex.join(head + sys.argv[1:])])


def add_bench_args(parser: argparse.ArgumentParser, pairs: int = DEFAULT_PAIRS) -> argparse.ArgumentParser:
    """The standard bench flags: --smoke (a size that finishes in seconds), --pairs, --json-out."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes that finish in seconds (CI runs every bench this way)")
    parser.add_argument("--pairs", type=int, default=None,
                        help=f"interleaved rounds per comparison (default {pairs}, 1 with --smoke)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="append one JSON line per measurement here (default bench/results/<bench>.jsonl; "
                             "bench/out/smoke/<bench>.jsonl with --smoke)")
    parser.set_defaults(_default_pairs=pairs)
    return parser


def pairs_from(args: argparse.Namespace) -> int:
    """Rounds to run: --pairs if given, else 1 for --smoke, else the bench's default (at least 3)."""
    if args.pairs is not None:
        return max(args.pairs, 1)
    return 1 if args.smoke else getattr(args, "_default_pairs", DEFAULT_PAIRS)


def json_path(bench: str, args: argparse.Namespace) -> Path:
    """Where this run's JSON lines go (smoke runs never touch the tracked bench/results/)."""
    if args.json_out is not None:
        return args.json_out
    return (SMOKE_DIR if args.smoke else RESULTS_DIR) / f"{bench}.jsonl"


def _as_metrics(value: Value, default_metric: str) -> dict[str, float]:
    if isinstance(value, dict):
        return {key: float(number) for key, number in value.items()}
    return {default_metric: float(value)}


def _append(path: Path | None, record: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def compare(bench: str, sides: Sequence[Side], *, pairs: int = DEFAULT_PAIRS, baseline: str | None = None,
            metric: str = "value", json_out: Path | None = None, label: str = "",
            warmup: bool = False) -> Comparison:
    """Run `sides` interleaved for `pairs` rounds (A, B, A, B, ...); ratios are to `baseline` (default: first side).

    `metric` names a side's result when it returns a bare number. With `warmup`,
    each side runs once untimed before the first round (imports, caches, JIT).
    Each measurement is appended to `json_out` as one JSON line as soon as it is taken.
    """
    names = [side.name for side in sides]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"sides need distinct names, got {names}")
    baseline = baseline or names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the sides {names}")
    result = Comparison(bench=bench, baseline=baseline, sides=names, command=command_line())
    result.values = {name: {} for name in names}
    if warmup:
        for side in sides:
            side.run()
    for round_index in range(pairs):
        for side in sides:
            state = machine()
            started = time.time()
            measured = _as_metrics(side.run(), metric)
            for key, number in measured.items():
                result.values[side.name].setdefault(key, []).append(number)
                _append(json_out, {"bench": bench, "label": label, "side": side.name, "baseline": baseline,
                                   "round": round_index, "metric": key, "value": number, "started": started,
                                   "seconds": round(time.time() - started, 4), "command": result.command, **state})
            result.loads.append((state["load1"], state["load5"], state["load15"]))
    return result


def measure(bench: str, name: str, run: Callable[[], Value], *, repeats: int = 1, metric: str = "value",
            json_out: Path | None = None, label: str = "") -> Comparison:
    """Repeat one callable (no sides to compare); same records as `compare`, ratios are all 1."""
    return compare(bench, [Side(name, run)], pairs=repeats, metric=metric, json_out=json_out, label=label)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain markdown table (numbers right-aligned), ready to paste into bench/RESULTS.md."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            if abs(value) >= 10:
                return f"{value:,.1f}"
            return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"
        return str(value)

    rows = [list(row) for row in rows]
    body = [[cell(value) for value in row] for row in rows]
    numeric = [bool(rows) and all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    align = ["---:" if is_number else "---" for is_number in numeric]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> None:
    """Print a markdown table (with an optional `## title` line) to stdout."""
    if title:
        print(f"\n## {title}")
    print(markdown_table(headers, list(rows)))


def _ratio(value: float) -> str:
    return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3f}"


def comparison_rows(result: Comparison) -> list[list[object]]:
    """One row per side and metric: median value, median ratio to the baseline, min and max ratio, rounds."""
    rows: list[list[object]] = []
    for metric in result.metrics:
        for side in result.sides:
            if metric not in result.values[side]:
                continue
            low, high = result.spread(side, metric)
            median = result.median_ratio(side, metric)
            ratio, spread = ("-", "-") if median != median else (f"{_ratio(median)}x", f"{_ratio(low)}-{_ratio(high)}x")
            rows.append([side, metric, result.median(side, metric), ratio, spread, len(result.values[side][metric])])
    return rows


def load_summary(result: Comparison) -> str:
    """'load1 0.8-2.1 on 2 cpus' over the comparison's measurements."""
    ones = [load[0] for load in result.loads] or [os.getloadavg()[0]]
    return f"load1 {min(ones):.1f}-{max(ones):.1f} on {os.cpu_count()} cpus"


def print_comparison(result: Comparison, title: str = "", json_out: Path | None = None) -> None:
    """The comparison's table, then the command that reproduces it, the machine load and where the JSON went."""
    print_table(["side", "metric", "median", f"vs {result.baseline} (median)", "ratio min-max", "rounds"],
                comparison_rows(result), title=title or result.bench)
    print(f"Command: `{result.command}`")
    print(f"Machine: {load_summary(result)}; interleaved rounds, ratios taken within each round")
    if json_out is not None:
        print(f"JSON lines: {json_out}")


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[dict[str, str]]:
    """A Prefect API for a bench's flows: the one PREFECT_API_URL names if it answers, else a fresh one under `home`.

    A server the bench starts is stopped on exit, after Prefect's queued logs and
    events are shipped (drain_prefect_workers), so no process outlives the bench.
    A server named by PREFECT_API_URL outlives the bench (the CI smoke test runs
    every bench against one); its queues are drained on exit all the same.
    """
    url = os.environ.get("PREFECT_API_URL")
    if url:
        import httpx

        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=2).status_code == 200:
                try:
                    yield {"PREFECT_API_URL": url}
                finally:
                    drain_prefect_workers()
                return
        except httpx.HTTPError:
            pass
    from factory.inference.local_server import free_port

    with temporary_local_prefect(home, free_port()) as environ:
        yield environ
