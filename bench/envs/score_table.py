"""What each shipped environment scores with a capable model and with the starter policy (README's env table).

"Capable model": the scripted reference policy (environments/reference_policy.py) answering every item right
from the env's own references; it shows the top of the env's scale and that scoring accepts a right answer.
"Starter policy": models/starter-policy on the local CPU server. Both through the env's `evaluate` (greedy,
one answer per eval item), as `python environments/<env>.py evaluate` runs it.

    python -m bench.envs.score_table --items 32 [--skip-starter] [--out bench/results/env_scores.json]
    python -m bench.envs.score_table --markdown     # the README table from the results file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from environments.base import EnvSpec
from environments.registry import BUILTIN
from factory.inference.client import InferenceClient, InferenceConfig
from tasks.generate import ClientSampler, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
STARTER = REPO / "models" / "starter-policy"
CONFIGS: dict[str, dict[str, Any]] = {  # the shipped deployments' env sections, offline data
    "gsm8k": {"data_file": str(REPO / "environments/data/gsm8k_sample.jsonl"), "max_tokens": 256},
    "math": {"data_file": str(REPO / "environments/data/math_sample.jsonl"), "max_tokens": 256},
    "multiple_choice": {"data_file": str(REPO / "environments/data/mmlu_sample.jsonl"), "max_tokens": 32},
    "reasoning_gym": {"mix": {"basic_arithmetic": 1, "chain_sum": 1}, "max_tokens": 64},
    "intern_bootcamp": {"max_tokens": 64},
    "code_exec": {"max_tokens": 128, "wall_s": 5.0},
    "shape_count": {"max_tokens": 16},
    "chess": {"max_tokens": 16},
    "chess_play": {"mode": "play", "diagram": False, "max_moves": 3, "max_tokens": 16},
    "tool_calling": {"compact_prompt": True, "max_turns": 5, "max_tokens": 144},
    "blackjack": {"max_turns": 6, "max_tokens": 16},
    "llm_judge": {"max_tokens": 64},
}


NEEDS = {  # packages beyond the core install, data, network
    "blackjack": "nothing (own rules)",
    "chess": "`chess` (python-chess)",
    "chess_play": "`chess` (python-chess)",
    "code_exec": "the sandbox (Linux; root for namespaces and its own uid)",
    "gsm8k": "math-verify; `openai/gsm8k` from the hub (network) or the shipped 40 problems",
    "intern_bootcamp": "nothing (own generated tasks)",
    "llm_judge": "a judge endpoint (a second model); shipped 8 prompts",
    "math": "math-verify; `HuggingFaceH4/MATH-500` from the hub (network) or the shipped 24 problems",
    "multiple_choice": "`cais/mmlu` from the hub (network) or the shipped 16 questions",
    "reasoning_gym": "`reasoning-gym==0.1.25` (offline)",
    "shape_count": "Pillow; a vision model to be meaningful (text-only policies see `<image>`)",
    "tool_calling": "nothing (own tools and bills)",
}


def markdown(path: str) -> str:
    """The README table from a results file."""
    data = json.loads(Path(path).read_text())

    def cell(metrics: dict[str, float] | None) -> str:
        if not metrics:
            return "not measured (needs a real judge: the stand-in judge only tells its own answers apart)"
        if "win_rate_vs_reference" in metrics:
            return f"{metrics['win_rate_vs_reference']:.2f} win rate vs the reference (the same answer: a tie)"
        return f"{metrics['mean_score']:.2f} ({metrics['accuracy']:.0%})"

    rows = ["| env | needs | capable (reference policy) | starter policy |", "|---|---|---|---|"]
    for name, result in sorted(data["results"].items()):
        label = "`chess` (`mode: play`)" if name == "chess_play" else f"`{name}`"
        starter = None if name == "llm_judge" else result.get("starter")
        rows.append(f"| {label} | {NEEDS.get(name, '')} | {cell(result.get('capable'))} | {cell(starter)} |")
    return "\n".join(rows)


def evaluate(name: str, url: str, items: int, judge_url: str, reference: Any | None) -> dict[str, float]:
    config = {"eval_items": items, "max_token_length": 512, **CONFIGS[name]}
    if name == "llm_judge":
        config["judge"] = {"base_url": judge_url, "server_type": "openai", "model_name": "reference-policy"}
    env = EnvSpec(BUILTIN[name.removesuffix("_play")], config).build()
    env.setup()
    if reference is not None:
        reference.add(env, [env.get_eval_item(i) for i in range(items)])
    tokenizer = load_tokenizer(str(STARTER))
    api = "chat" if reference is not None else "generate"

    async def run() -> dict[str, float]:
        server = "openai" if reference is not None else "sglang"
        async with InferenceClient(InferenceConfig(base_url=url, server_type=server, model_name="m")) as client:
            metrics, _ = await env.evaluate(ClientSampler(client, tokenizer, api))
            return metrics

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--envs", nargs="*", default=sorted(CONFIGS))
    parser.add_argument("--skip-starter", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench/results/env_scores.json"))
    parser.add_argument("--markdown", action="store_true", help="print the README table of --out and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    from environments.reference_policy import ReferencePolicy, serve
    from factory.inference.local_server import start_local_server

    results: dict[str, dict[str, Any]] = {}
    # the judge of llm_judge is always the reference policy (the starter cannot judge), for both rows
    judge = ReferencePolicy(1)
    with serve(ReferencePolicy(1, always_right=True)) as capable_url, serve(judge) as judge_url:
        for name in args.envs:
            started = time.perf_counter()
            policy = ReferencePolicy(1, always_right=True)
            with serve(policy) as url:
                results[name] = {"capable": evaluate(name, url, args.items, judge_url, policy)}
            print(name, "capable", results[name]["capable"], f"{time.perf_counter() - started:.1f}s", flush=True)
        if not args.skip_starter:
            with start_local_server(STARTER) as handle:
                for name in args.envs:
                    if name == "llm_judge":  # the stand-in judge cannot judge real answers
                        continue
                    started = time.perf_counter()
                    results[name]["starter"] = evaluate(name, handle.base_url, args.items, judge_url, None)
                    seconds = time.perf_counter() - started
                    print(name, "starter", results[name]["starter"], f"{seconds:.1f}s", flush=True)
    del capable_url
    Path(args.out).write_text(json.dumps({"items": args.items, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
