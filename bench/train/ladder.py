"""Pass rate of a policy per family and difficulty level, on eval-side problems of the content split (greedy and
temperature 1): how steep each family's ladder is for that policy. Rows go to bench/results/rl_ladder.jsonl.

    python -m bench.train.ladder --policy models/starter-policy --levels 1 2 3 --per_family 40
    python -m bench.train.ladder --policy /tmp/rl/s0/store/rl/train/checkpoints/step-00000100 --label after-s0
    python -m bench.train.ladder --smoke                 # seconds; rows go to bench/out/smoke/rl_ladder.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import SMOKE_DIR, command_line, machine, print_table
from environments.bootcamp_tasks import FAMILIES
from environments.bootcamp_tasks.split import ContentSplit, build_eval_set
from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv
from factory.train.evaluate import evaluate_items

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "rl_ladder.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="models/starter-policy")
    parser.add_argument("--label", default="starter")
    parser.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    parser.add_argument("--levels", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--per_family", type=int, default=40)
    parser.add_argument("--max_tokens", type=int, default=24)
    parser.add_argument("--smoke", action="store_true", help="3 families, levels 1-2, 4 problems each")
    args = parser.parse_args(argv)
    results = RESULTS
    if args.smoke:
        args.families, args.levels, args.per_family = ["modulo", "reverse", "sorting"], [1, 2], 4
        results = SMOKE_DIR / RESULTS.name
        results.parent.mkdir(parents=True, exist_ok=True)
    from factory.inference.engine import PolicyEngine

    split = ContentSplit()
    env = InternBootcampEnv(InternBootcampConfig(weights={f: 1.0 for f in args.families}, split="eval"))
    engine = PolicyEngine(args.policy)
    rows, table = [], []
    for level in args.levels:
        evalset = build_eval_set(args.families, level, args.per_family, split, min_problems=1)
        items = [env._item(i, c) for i, c in enumerate(evalset.cases)]
        for temperature in (0.0, 1.0):
            result = evaluate_items(args.policy, env, items, temperature=temperature, max_tokens=args.max_tokens,
                                    engine=engine)
            for family, (correct, n) in result.per_family.items():
                rows.append({"bench": "rl_ladder", "label": args.label, "policy": args.policy, "family": family,
                             "level": level, "temperature": temperature, "correct": correct, "n": n,
                             "pass_rate": round(correct / n, 4), "distinct_eval_problems": evalset.distinct[family],
                             "command": command_line(), "recorded": time.time(), **machine()})
    with results.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    by = {(r["family"], r["level"], r["temperature"]): r["pass_rate"] for r in rows}
    for family in args.families:
        table.append([family, *(f"{by.get((family, lv, 0.0), 0):.2f} / {by.get((family, lv, 1.0), 0):.2f}"
                                for lv in args.levels)])
    print_table(["family", *(f"level {lv} greedy / T=1" for lv in args.levels)], table, f"{args.label}: {args.policy}")


if __name__ == "__main__":
    main()
