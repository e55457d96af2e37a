"""The RL loop's report: before/after accuracy on unseen problems (greedy and temperature 1, trained level and one
above, n and 95% interval), where the time went, busy share and policy lag; as JSON, markdown and one PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from factory.train.evaluate import EvalResult, wilson_interval


def eval_rows(phase: str, results: dict[tuple[int, str, float], EvalResult], headline: dict[int, list[str]]
              ) -> list[dict[str, Any]]:
    """One row per (phase, level, temperature, family) plus a headline row per (level, temperature)."""
    rows = []
    for (level, role, temperature), result in results.items():
        head = result.subset(set(headline[level]))
        low, high = head.interval95
        rows.append({"phase": phase, "level": level, "role": role, "temperature": temperature, "family": "headline",
                     "families": headline[level], "correct": head.correct, "n": head.n,
                     "accuracy": round(head.accuracy, 4), "ci95": [round(low, 4), round(high, 4)]})
        for family, (correct, n) in result.per_family.items():
            low, high = wilson_interval(correct, n)
            rows.append({"phase": phase, "level": level, "role": role, "temperature": temperature, "family": family,
                         "headline": family in headline[level], "correct": correct, "n": n,
                         "accuracy": round(correct / n if n else 0.0, 4), "ci95": [round(low, 4), round(high, 4)]})
    return rows


def headline_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before vs after per (level, temperature) on the headline families."""
    heads = {(r["phase"], r["level"], r["temperature"]): r for r in rows if r["family"] == "headline"}
    table = []
    for (phase, level, temperature), before in sorted(heads.items()):
        if phase != "before":
            continue
        after = heads.get(("after", level, temperature))
        table.append({"level": level, "role": before["role"], "temperature": temperature,
                      "families": before["families"], "n": before["n"], "before": before["accuracy"],
                      "before_ci95": before["ci95"], "after": after["accuracy"] if after else None,
                      "after_ci95": after["ci95"] if after else None,
                      "change": round(after["accuracy"] - before["accuracy"], 4) if after else None})
    return table


def markdown(title: str, table: list[dict[str, Any]], plan_lines: list[str], phases: dict[str, float],
             timing: dict[str, float]) -> str:
    def ci(pair: list[float] | None) -> str:
        return f"[{pair[0]:.3f}, {pair[1]:.3f}]" if pair else ""

    lines = [f"## {title}", "", *plan_lines, "",
             "| level | sampling | families (headline) | n | before | 95% CI | after | 95% CI | change |",
             "|---|---|---|---:|---:|---|---:|---|---:|"]
    for r in table:
        sampling = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']:g}"
        after = f"{r['after']:.3f}" if r["after"] is not None else "-"
        change = f"{r['change']:+.3f}" if r["change"] is not None else "-"
        lines.append(f"| {r['level']} ({r['role']}) | {sampling} | {', '.join(r['families'])} | {r['n']} | "
                     f"{r['before']:.3f} | {ci(r['before_ci95'])} | {after} | {ci(r['after_ci95'])} | {change} |")
    lines += ["", "| where the time went | seconds |", "|---|---:|", *(f"| {k} | {v:.1f} |" for k, v in phases.items()),
              *(f"| {k} | {v:.1f} |" for k, v in timing.items() if k.endswith("_s"))]
    share, lag_mean, lag_max = timing.get("busy_share"), timing.get("policy_lag_mean"), timing.get("policy_lag_max")
    if share is not None:
        lines.append(f"\ninference server busy {share:.0%} of the trainer process's wall clock (its start-up included); weight loads "
                     f"{timing.get('server_update_s', 0):.1f} s")
    if timing.get("busy_share_training") is not None:
        lines.append(f"inference server busy {timing['busy_share_training']:.0%} of the training window (first step "
                     f"asked for to last step done, {timing.get('training_window_s', 0):.0f} s)")
    if lag_mean is not None:
        lines.append(f"policy lag of the trained batches: mean {lag_mean:.2f}, max {lag_max:.0f} steps")
    return "\n".join(lines) + "\n"


def plot(path: Path, metric_rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> Path:
    """Reward curve (left) and before/after accuracy with 95% intervals on unseen problems (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    if metric_rows:
        steps = [r["step"] for r in metric_rows]
        rewards = [r["reward_mean"] for r in metric_rows]
        smooth = [sum(rewards[max(0, i - 9): i + 1]) / len(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]
        left.plot(steps, rewards, alpha=0.35, label="batch reward mean")
        left.plot(steps, smooth, label="moving average (10)")
        left.legend(loc="lower right")
    left.set_xlabel("trainer step")
    left.set_ylabel("reward")
    left.set_title("training reward")
    left.grid(alpha=0.3)
    labels, width = [], 0.38
    for i, r in enumerate(table):
        sampling = "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}"
        labels.append(f"L{r['level']} {r['role']}\n{sampling} (n={r['n']})")
        for offset, key, color in ((-width / 2, "before", "tab:gray"), (width / 2, "after", "tab:blue")):
            value, pair = r[key], r[f"{key}_ci95"]
            if value is None:
                continue
            right.bar(i + offset, value, width, color=color, label=key if i == 0 else None,
                      yerr=[[value - pair[0]], [pair[1] - value]], capsize=3)
    right.set_xticks(range(len(labels)), labels, fontsize=8)
    right.set_ylabel("accuracy on unseen problems")
    right.set_title("eval (95% Wilson intervals)")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3, axis="y")
    right.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def training_window(metric_rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(wall-clock time the first step asked for its batch, time the last step finished) from metrics rows."""
    rows = [r for r in metric_rows if r.get("time") is not None]
    if not rows:
        return None
    first = rows[0]
    return first["time"] - (first.get("wait_s") or 0.0) - (first.get("compute_s") or 0.0), rows[-1]["time"]


def busy_share_in(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Share of [start, end] the server spent generating, from (wall time, cumulative busy seconds) samples: the
    first and last sample inside the window (None with fewer than two)."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    return (b1 - b0) / (t1 - t0)
