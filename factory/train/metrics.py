"""Per-step metrics: a JSONL file beside the checkpoints (truncated on resume), a reward-curve PNG, optional W&B."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLog:
    """Append-only `metrics.jsonl`; `resume(step)` drops lines of steps after `step` (they will be redone)."""

    def __init__(self, path: str | Path, *, wandb_run: Any = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb_run

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def resume(self, step: int) -> None:
        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])


def open_wandb(enabled: bool, project: str, config: dict[str, Any]) -> Any:
    """A W&B run when asked for and installed; otherwise None (W&B is never required)."""
    if not enabled:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("train.wandb is on but wandb is not installed; logging to metrics.jsonl only")
        return None
    return wandb.init(project=project, config=config)


def plot_reward_curve(rows: list[dict[str, Any]], path: str | Path, *, window: int = 5) -> Path | None:
    """reward_mean per step (and a moving average) as a PNG; None when there is nothing to plot."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, alpha=0.35, label="batch reward mean")
    ax.plot(steps, smooth, label=f"moving average ({window})")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
