"""What the RL loop checks and builds before anything starts: its config, the inputs, and the train/eval split.

Training draws only train-side problems of the content split (environments/bootcamp_tasks/split.py), the
eval sets hold only distinct eval-side problems, at the trained level(s) and one level above. Before the run
the planned training items (the first `datagen_items` the datagen flow can draw) are enumerated and compared
with the eval sets by problem id; a non-zero overlap stops the run. Families too small to give
`min_eval_problems` distinct eval problems at a level stay out of that level's headline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from environments.bootcamp_tasks.base import MAX_DIFFICULTY, Case
from environments.bootcamp_tasks.split import ContentSplit, EvalSet, build_eval_set, load_keys, overlap
from factory.config import FactoryConfig

MIN_BUDGET_S = 20.0
"""Less wall clock than this cannot train one step here: the trainer's start-up and the first batch (8 groups of 8
from a cold policy server) take 10-20 s on this 2-core machine."""

MAX_PLANNED_ITEMS = 50_000
"""Most planned training items enumerated for the overlap check (the check is by construction past that)."""


class LoopInputError(ValueError):
    """Bad input found before training starts; the message is one line naming the value and the fix."""


class RLLoopConfig(FactoryConfig):
    """The loop's knobs (flat keys: `--budget_s 300`). Stopping rule: `total_steps` if set, else `budget_s`."""

    out_dir: str = Field("runs/rl-loop", description="Everything the loop makes goes here (wiped at start).")
    policy: str = Field("models/starter-policy", description="Starting policy directory (a HF model directory).")
    budget_s: float = Field(900.0, gt=0, description="Stopping rule when total_steps is not set: seconds of training "
                                                     "wall clock (the trainer stops at the first step boundary after).")
    total_steps: int | None = Field(None, ge=1, description="Stopping rule when set: exactly this many trainer steps "
                                                            "(budget_s is then ignored).")
    seed: int = Field(0, description="Seed of the training items drawn, the trainer's RNGs and the eval sampling.")
    families: list[str] = Field(["gcd", "sorting", "string_transform", "modulo"],
                                description="InternBootcamp families, equal weights (the mix trained and evaluated).")
    difficulties: list[int] = Field([1], description="Difficulty levels trained (eval: these and one level above).")
    eval_share: float = Field(0.25, gt=0, lt=1, description="Share of each family's problems kept for eval only.")
    eval_per_family: int = Field(150, ge=1, description="Distinct eval problems per family and level.")
    min_eval_problems: int = Field(50, ge=1, description="A family with fewer distinct eval problems at a level "
                                                         "(its space is too small) is left out of that headline.")
    eval_set: str | None = Field(None, description="JSONL of case keys ({'key': 'gcd:1:42'}) to evaluate at the "
                                                   "trained level instead of the built set; checked for overlap.")
    group_size: int = Field(8, ge=2, description="Responses per problem.")
    batch_size: int = Field(64, ge=1, description="Sequences per trainer step.")
    lr: float = Field(3e-4, gt=0, description="Trainer learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Trainer linear warmup steps.")
    checkpoint_every: int = Field(2, ge=1, description="Checkpoint + weight push every K steps.")
    max_policy_lag: int = Field(2, ge=0, description="Batching API skips groups more than this many versions old.")
    max_batches_offpolicy: int = Field(2, ge=0, description="Datagen pauses while this many batches wait.")
    chunk_items: int = Field(8, ge=1, description="Problems per datagen chunk (one shard).")
    datagen_items: int = Field(50000, ge=1, le=MAX_PLANNED_ITEMS,
                               description="Problems datagen may make (it is stopped when training ends). Enough for "
                               "the budget: a quiet 2-core machine drew 20,000 in 860 s of a 900 s run.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for datagen (eval: greedy and 1.0).")
    max_tokens: int = Field(24, ge=1, description="Most new tokens per answer.")
    train_config: str = Field("deployments/train_grpo.yaml", description="Trainer YAML the loop's keys override.")
    env_config: str = Field("deployments/intern_bootcamp.yaml", description="Datagen YAML the loop's keys override.")


@dataclass
class LevelEval:
    """One eval level: its distinct eval-side problems and which of its families count in the headline."""

    level: int
    role: str  # "trained" or "above"
    evalset: EvalSet

    @property
    def headline_families(self) -> list[str]:
        return sorted({c.family for c in self.evalset.headline()})


@dataclass
class RLPlan:
    levels: list[LevelEval]
    planned_train_items: int
    overlap: int
    overlap_examples: list[str] = field(default_factory=list)


def check_inputs(cfg: RLLoopConfig, root: Path) -> None:
    """Fail fast, one line each: a missing starter policy, a budget too small for a step, an unknown family."""
    policy = Path(cfg.policy) if Path(cfg.policy).is_absolute() else root / cfg.policy
    if not (policy / "config.json").is_file():
        raise LoopInputError(f"starter policy missing: {policy} has no config.json; build it with "
                             f"`python scripts/build_starter_policy.py --out {cfg.policy}` (or run scripts/rl_loop.sh)")
    if cfg.total_steps is None and cfg.budget_s < MIN_BUDGET_S:
        raise LoopInputError(f"budget_s {cfg.budget_s:g} is too small for one trainer step (start-up and the first "
                             f"batch take 10-20 s here); give --budget_s {MIN_BUDGET_S:g} or more, or --total_steps N")
    from environments.bootcamp_tasks import FAMILIES

    unknown = [f for f in cfg.families if f not in FAMILIES]
    if unknown:
        raise LoopInputError(f"unknown families {unknown}; known: {', '.join(sorted(FAMILIES))}")
    if not cfg.difficulties or any(not 1 <= d <= MAX_DIFFICULTY for d in cfg.difficulties):
        raise LoopInputError(f"difficulties {cfg.difficulties} must be levels 1..{MAX_DIFFICULTY}, e.g. [1]")
    if cfg.eval_set is not None and not Path(cfg.eval_set).is_file():
        raise LoopInputError(f"eval_set {cfg.eval_set} does not exist; give a JSONL of case keys or leave it unset")


def train_env(cfg: RLLoopConfig, side: str = "train"):
    from environments.intern_bootcamp import InternBootcampConfig, InternBootcampEnv

    return InternBootcampEnv(InternBootcampConfig(weights={f: 1.0 for f in cfg.families}, difficulties=cfg.difficulties,
                                                  split=side, eval_share=cfg.eval_share, seed=cfg.seed))


def eval_levels(cfg: RLLoopConfig) -> list[tuple[int, str]]:
    trained = sorted(set(cfg.difficulties))
    above = max(trained) + 1
    return [(level, "trained") for level in trained] + ([(above, "above")] if above <= MAX_DIFFICULTY else [])


def build_plan(cfg: RLLoopConfig) -> RLPlan:
    """The eval sets, and the overlap of the planned training items with them (must be 0)."""
    split = ContentSplit(cfg.eval_share)
    levels = []
    for level, role in eval_levels(cfg):
        evalset = build_eval_set(cfg.families, level, cfg.eval_per_family, split, min_problems=cfg.min_eval_problems)
        if cfg.eval_set is not None and role == "trained" and level == min(cfg.difficulties):
            cases = load_keys(cfg.eval_set)
            evalset = EvalSet(level=level, cases=cases, distinct={f: sum(c.family == f for c in cases)
                                                                  for f in {c.family for c in cases}})
        levels.append(LevelEval(level, role, evalset))
    env = train_env(cfg)
    planned: list[Case] = [env.get_item(i).answer for i in range(min(cfg.datagen_items, MAX_PLANNED_ITEMS))]
    shared = overlap(planned, [c for lv in levels for c in lv.evalset.cases])
    return RLPlan(levels, len(planned), len(shared), sorted(shared)[:3])


def check_plan(plan: RLPlan) -> None:
    if plan.overlap:
        raise LoopInputError(f"eval set overlaps training: {plan.overlap} eval problems are among the "
                             f"{plan.planned_train_items} planned training items (e.g. {plan.overlap_examples[0]!r}); "
                             "use eval-side problems only (leave eval_set unset to build them)")
    for lv in plan.levels:
        if lv.role == "trained" and not lv.headline_families:
            raise LoopInputError(f"no family has min_eval_problems distinct eval problems at level {lv.level} "
                                 f"(found {lv.evalset.distinct}); add families with larger spaces or lower it")
