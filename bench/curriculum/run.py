"""Static difficulty vs the adaptive curriculum: how many items and rollouts a kept (informative) group costs.

    OMP_NUM_THREADS=1 python -m bench.curriculum.run --items 200 --group-size 8 --pairs 3    # full
    OMP_NUM_THREADS=1 python -m bench.curriculum.run --smoke                       # seconds

The starter policy (models/starter-policy, falls back to a tiny random one if it is missing) is served by the
local CPU server; the InternBootcamp mix (14 families, equal weights, group_size 16, max_tokens 24, as in
deployments/intern_bootcamp.yaml) is drawn, sampled, scored and grouped by the datagen flow's plain functions
(tasks/generate, tasks/score, tasks/group) and chunked by factory/sampling.py exactly as the flow does, minus
Prefect (a yield ratio does not depend on the orchestrator). Arms, run in turn for each seed (interleaved):

- static:   env.difficulties [1] (the deployment's default);
- adaptive: datagen.curriculum (band 0.2-0.8, every family starting at level 1);
- reweight: levels held at 1 (band 0-1: no pass rate moves a level), families weighed as below;
- adaptive+reweight: the same, with families weighed by their recent share of kept groups.

Per arm: items tried, groups kept, the share of items that yield a kept group, and rollouts spent per kept group.
Arms run interleaved through bench/harness.py (round r uses seed r for every arm); ratios to static are taken
within each round, then the median. JSON lines: bench/results/curriculum.jsonl (bench/out/smoke/ with --smoke).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
REF = "environments.intern_bootcamp:InternBootcampEnv"
ARMS = {
    "static": None,
    "adaptive": {"enabled": True},
    # levels held at 1 (a band no pass rate leaves), families reweighted: what reweighting alone buys
    "reweight": {"enabled": True, "reweight": True, "low": 0.0, "high": 1.0},
    "adaptive+reweight": {"enabled": True, "reweight": True},
}


def run_arm(base_url: str, model: str, *, seed: int, items: int, chunk_items: int, curriculum: dict | None,
            group_size: int) -> dict[str, Any]:
    """One arm: draw `items` items chunk by chunk (curriculum updated after each chunk), count what is kept."""
    from environments.base import EnvSpec, load_env
    from factory.curriculum import CurriculumSettings
    from factory.inference.client import InferenceConfig
    from factory.sampling import DynamicSampling, chunk_stats_name, make_curriculum
    from factory.store import ShardStore
    from tasks.rollout import rollout_chunk

    env_config = {"group_size": group_size, "max_tokens": 24, "max_token_length": 256, "temperature": 1.0,
                  "difficulties": [1], "seed": seed, "tokenizer_name": model}
    spec = EnvSpec(REF, env_config)
    env = load_env(spec)
    cur = make_curriculum(CurriculumSettings(**(curriculum or {})), env, start_level=1)
    openai = InferenceConfig(base_url=base_url, model_name="starter-policy", server_type="sglang",
                             num_max_requests_at_once=64)
    with tempfile.TemporaryDirectory() as root:
        store = ShardStore(root)
        sampler = DynamicSampling(store, run_id="bench", producer="ib", chunk_items=chunk_items, total_items=items,
                                  chunks_in_flight=1, curriculum=cur, solved=env.solved)
        rollouts = kept = tried = 0
        started = time.perf_counter()
        while (chunk := sampler.next_chunk()) is not None:
            grouped = rollout_chunk(spec, "intern_bootcamp", chunk, sampler.indices(chunk), openai,
                                    generate=dict(tokenizer_name=model, api="generate", max_in_flight=32,
                                                  plan=sampler.plan_for(chunk)),
                                    score=dict(mode="inline"), group=dict(group_size=group_size, max_token_length=256))
            stats = {**grouped.stats(), "chunk": chunk, **sampler.chunk_stats(chunk, grouped)}
            store.write_run_file("bench", chunk_stats_name("ib", chunk), json.dumps(stats))
            store.commit("bench", "ib", chunk, grouped)
            sampler.committed(chunk, stats)
            rollouts += grouped.rollouts
            kept += len(grouped.groups)
            tried += stats["items"]
            print(f"  chunk {chunk}: kept {len(grouped.groups)}/{stats['items']} ({time.perf_counter() - started:.0f}s)",
                  flush=True)
        seconds = time.perf_counter() - started
    return {"seed": seed, "items": tried, "groups_kept": kept, "rollouts": rollouts,
            "kept_share": kept / tried if tried else 0.0,
            "rollouts_per_kept_group": rollouts / kept if kept else None, "seconds": round(seconds, 1),
            "levels": cur.levels() if cur else None}


def main(argv: list[str] | None = None) -> None:
    from bench import harness

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200, help="Items per arm and round.")
    parser.add_argument("--chunk-items", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=16)
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.items, args.chunk_items, args.group_size = 12, 6, 4
    pairs, json_out = harness.pairs_from(args), harness.json_path("curriculum", args)

    from factory.inference.local_server import start_local_server

    model = REPO / "models" / "starter-policy"
    if not (model / "config.json").is_file():
        from factory.inference.tiny_model import make_tiny_policy

        model = make_tiny_policy(Path(tempfile.mkdtemp()) / "tiny")
        print(f"starter policy missing: using a tiny random policy at {model}")
    totals: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}

    with start_local_server(model, wait_s=600) as server:  # a loaded shared machine can take minutes
        def side(arm: str, curriculum: dict | None) -> Any:
            def run() -> dict[str, float]:
                seed = len(totals[arm])  # round r draws the items of seed r, the same seed for every arm
                row = run_arm(server.base_url, str(model), seed=seed, items=args.items, chunk_items=args.chunk_items,
                              curriculum=curriculum, group_size=args.group_size)
                totals[arm].append(row)
                print(f"seed {seed} {arm:18s} kept {row['groups_kept']:4d}/{row['items']} items "
                      f"({row['kept_share']:.3f}), {row['seconds']}s, levels {row['levels']}", flush=True)
                return {"kept share": row["kept_share"],
                        "rollouts per kept group": row["rollouts_per_kept_group"] or float("inf")}
            return run

        result = harness.compare("curriculum", [harness.Side(arm, side(arm, c)) for arm, c in ARMS.items()],
                                 pairs=pairs, json_out=json_out)
    print(f"\n{args.items} items per arm and round (round r = seed r, the same seed for every arm), "
          f"group_size {args.group_size}, chunks of {args.chunk_items}, {pairs} rounds")
    harness.print_table(["arm", "items", "groups kept", "kept share", "rollouts per kept group"], [
        [arm, sum(r["items"] for r in rows), sum(r["groups_kept"] for r in rows),
         sum(r["groups_kept"] for r in rows) / max(1, sum(r["items"] for r in rows)),
         sum(r["rollouts"] for r in rows) / max(1, sum(r["groups_kept"] for r in rows))]
        for arm, rows in totals.items()], title="curriculum: totals over all rounds")
    harness.print_comparison(result, title="curriculum: per-round ratios to static", json_out=json_out)


if __name__ == "__main__":
    main()
