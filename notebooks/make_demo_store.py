"""Make a small demo store for the notebooks: two environments, InternBootcamp-style item keys, a stats file.

    python notebooks/make_demo_store.py --store data-demo --run demo --groups 120

Groups come from `factory.synthetic` with per-family score rates, lengths and
readable messages, so plots show differences between families; the run gets a
`stats-demo.json` in the shape the datagen flow writes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from environments.groups import make_group_id
from factory.store import ShardStore
from factory.synthetic import synthetic_group

FAMILIES = {"arithmetic": (0.7, 48), "sorting": (0.45, 80), "cipher": (0.2, 128), "logic_grid": (0.35, 160)}
"""family -> (chance a sequence is right, sequence length)."""


def make_demo_store(store_root: str | Path, run_id: str = "demo", groups: int = 120, group_size: int = 4) -> Path:
    """Write `groups` groups (about 3/4 InternBootcamp, 1/4 gsm8k) to `run_id`; return the run dir."""
    store = ShardStore(store_root)
    rng = random.Random(7)
    made, chunk = [], 0
    for index in range(groups):
        if index % 4 == 3:
            env, family, key = "gsm8k", "gsm8k", f"gsm8k-{index}"
            rate, seq_len = 0.55, 96
        else:
            env = "intern_bootcamp"
            family = list(FAMILIES)[index % len(FAMILIES)]
            rate, seq_len = FAMILIES[family]
            key = f"{family}:{index % 3 + 1}:{index}"
        group = synthetic_group(index, group_size=group_size, seq_len=seq_len + rng.randrange(-8, 9), env=env,
                                run_id=run_id)
        scores = [1.0 if rng.random() < rate else rng.choice([0.0, -1.0]) for _ in range(group_size)]
        question = f"[{family}] task {index}: give the answer in \\boxed{{}}."
        messages = [
            [{"role": "user", "content": question},
             {"role": "assistant", "content": f"<think>step by step</think> The answer is \\boxed{{{index + k}}}."
              + (" (checked)" if s > 0 else "")}]
            for k, s in enumerate(scores)
        ]
        made.append(group.model_copy(update={
            "scores": scores, "messages": messages, "item_key": key,
            "group_id": make_group_id(env, key, 0, 0),
        }))
        if len(made) == 40:
            store.commit(run_id, "demo", chunk, made)
            made, chunk = [], chunk + 1
    if made:
        store.commit(run_id, "demo", chunk, made)
    stats = {"run_id": run_id, "producer": "demo", "chunks_committed": chunk + 1, "groups_kept": groups,
             "dropped": {"failed": 3, "wrong_size": 0, "too_long": 5, "equal_scores": groups // 5},
             "rollouts": (groups + 3 + 5 + groups // 5) * group_size}
    store.write_run_file(run_id, "stats-demo.json", json.dumps(stats, indent=2))
    return store.run_dir(run_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="data-demo", help="Store root to write to.")
    parser.add_argument("--run", default="demo", help="Run id.")
    parser.add_argument("--groups", type=int, default=120, help="Groups to write.")
    args = parser.parse_args()
    print(make_demo_store(args.store, args.run, args.groups))


if __name__ == "__main__":
    main()
