"""Build the starter policy offline: BPE tokenizer + chat template, a ~1M-parameter Qwen2 model, a short SFT warm start.

    python scripts/build_starter_policy.py                     # writes models/starter-policy (~6 min, 1 thread)
    python scripts/build_starter_policy.py --threads 2         # ~4 min on an idle 2-core machine
    python scripts/build_starter_policy.py --steps 300 --out /tmp/p

The warm start teaches the InternBootcamp task families' answer format and
some of their answers from `reference_completion`, so sampled groups at
temperature 1 are partly right: reward variance for GRPO to learn from. The
loss covers only the assistant turn (answer + end-of-turn token). At the end
the script samples held-out difficulty-1 cases (the easy level, the main
job's default mix) at temperature 1 with the local server's engine and writes
the accuracy per family to eval.json and README.md; `--eval-only` re-measures
an existing model directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from environments.bootcamp_tasks import FAMILIES  # noqa: E402
from environments.bootcamp_tasks.split import ContentSplit  # noqa: E402
from factory.inference.tiny_model import build_tokenizer, init_model  # noqa: E402

def sample_cases(rng: random.Random, count: int, difficulties: tuple[int, ...], side: str = "all") -> list:
    """`side` "train" draws only train-side problems of the RL loop's content split (environments/bootcamp_tasks/
    split.py, eval_share 0.25), so the starter never sees a problem the loop evaluates on; "all" draws any."""
    names = sorted(FAMILIES)
    if side == "all":
        return [FAMILIES[rng.choice(names)].generate(rng, rng.choice(difficulties)) for _ in range(count)]
    split = ContentSplit()
    return [split.draw(rng, rng.choice(names), rng.choice(difficulties), side) for _ in range(count)]


def encode_example(tokenizer, case) -> tuple[list[int], list[int]]:
    """Prompt tokens (chat template, generation prompt) and target tokens (reference answer + <|im_end|>)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": case.prompt}], add_generation_prompt=True,
                                           tokenize=False)
    answer = FAMILIES[case.family].reference_completion(case)
    return (tokenizer.encode(prompt, add_special_tokens=False),
            tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id])


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    length = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        seq = prompt + answer
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
        mask[row, : len(seq)] = 1
    return ids, labels, mask


def train(model, tokenizer, *, steps: int, batch_size: int, lr: float, seed: int, log_every: int = 50,
          side: str = "train") -> None:
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    start = time.monotonic()
    for step in range(steps):
        cases = sample_cases(rng, batch_size, (1,) * 9 + (2,), side)
        ids, labels, mask = make_batch([encode_example(tokenizer, c) for c in cases], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.monotonic() - start:6.1f} s", flush=True)
    model.eval()


def evaluate(model_dir: Path, *, per_family: int, seed: int) -> dict[str, float]:
    """Accuracy per family at temperature 1 on held-out difficulty-1 cases, sampled by the serving engine."""
    from factory.inference.engine import GenRequest, PolicyEngine

    engine = PolicyEngine(model_dir)
    rng = random.Random(seed + 10_000)
    accuracy = {}
    for name in sorted(FAMILIES):
        cases = [FAMILIES[name].generate(rng, 1) for _ in range(per_family)]
        requests = [GenRequest(encode_example(engine.tokenizer, c)[0], max_new_tokens=32, temperature=1.0,
                               seed=rng.getrandbits(31)) for c in cases]
        results = engine.generate_batch(requests)
        accuracy[name] = sum(FAMILIES[name].verify_score(c, r.text) >= 1.0 for c, r in zip(cases, results)) / len(cases)
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/starter-policy", help="output model directory")
    parser.add_argument("--steps", type=int, default=800, help="SFT steps")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=160)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eval-per-family", type=int, default=100)
    parser.add_argument("--corpus-cases", type=int, default=20_000, help="cases the tokenizer is trained on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true", help="only re-measure the model already in --out")
    parser.add_argument("--split-side", default="train", choices=["train", "all"],
                        help="SFT on train-side problems of the RL loop's content split only (default), or on any "
                             "problem ('all': how models/starter-policy was built before issue 25; it had seen 42 of "
                             "the 81 gcd level-2 eval problems and 8 of the 150 modulo ones)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more than 1 is much slower on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    started = time.monotonic()
    if args.eval_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        previous = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else {}
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
        write_report(out, args, params=params, vocab=len(AutoTokenizer.from_pretrained(out)),
                     train_minutes=previous.get("train_minutes", previous.get("build_minutes", float("nan"))))
        return

    corpus_rng = random.Random(args.seed + 1)
    corpus = []
    for case in sample_cases(corpus_rng, args.corpus_cases, (1, 2, 3)):
        corpus += [case.prompt, FAMILIES[case.family].reference_completion(case)]
    tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
    model = init_model(tokenizer, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                       intermediate=args.hidden * 3, max_positions=512, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; model: {params / 1e6:.2f}M parameters", flush=True)

    train(model, tokenizer, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
          side=args.split_side)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    minutes = (time.monotonic() - started) / 60
    write_report(out, args, params=params, vocab=len(tokenizer), train_minutes=minutes)


def write_report(out: Path, args: argparse.Namespace, *, params: int, vocab: int, train_minutes: float) -> None:
    accuracy = evaluate(out, per_family=args.eval_per_family, seed=args.seed)
    mean = sum(accuracy.values()) / len(accuracy)
    report = {"parameters": params, "vocab_size": vocab, "sft_steps": args.steps, "batch_size": args.batch_size,
              "train_minutes": round(train_minutes, 1), "temperature": 1.0, "difficulty": 1,
              "mean_accuracy": round(mean, 3), "accuracy": {k: round(v, 3) for k, v in accuracy.items()}}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    table = "\n".join(f"| {name} | {acc:.0%} |" for name, acc in sorted(accuracy.items()))
    (out / "README.md").write_text(
        f"# starter-policy\n\nA {params / 1e6:.2f}M-parameter Qwen2-style policy with a {vocab}-token BPE "
        f"vocabulary (digits split), built offline by `python scripts/build_starter_policy.py` ({args.steps} SFT "
        f"steps of {args.batch_size} InternBootcamp cases; {train_minutes:.1f} min to train on this machine).\n\n"
        f"Sampled at temperature 1 on held-out difficulty-1 cases ({args.eval_per_family} per family), it answers "
        f"**{mean:.0%} correctly** over all {len(accuracy)} families (the main job's default mix):\n\n"
        f"| family | correct |\n|---|---|\n{table}\n"
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
