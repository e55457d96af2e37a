#!/usr/bin/env bash
# The RL loop in one command (offline, CPU): the `rl-loop` Prefect flow (flows/rl_loop.py). Eval of the starter
# policy on problems training can never draw, local Prefect + policy server + batching API + InternBootcamp datagen
# (serve mode) + train-grpo until the stop rule, eval again, report in <out_dir>/report.{md,json,png}.
#   bash scripts/rl_loop.sh                              # deployments/rl_loop.yaml: 900 s (15 minutes) of training, seed 0
#   bash scripts/rl_loop.sh --budget_s 300 --seed 1 --out_dir runs/rl-s1
#   bash scripts/rl_loop.sh --total_steps 50             # stop rule: exactly 50 steps instead of the budget
#   bash scripts/rl_loop.sh --help                       # every key, its default and what it does
# It first makes or checks the checkout's venv ./.venv from uv.lock (scripts/setup.sh without Debian packages: the
# loop needs none), runs in it, and builds the starter policy if models/starter-policy is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -x .venv/bin/python ]; then
  echo "== making the checkout's venv .venv from uv.lock (scripts/setup.sh, no Debian packages)"
fi
FACTORY_SKIP_APT=1 bash scripts/setup.sh  # PYTHON picks the base interpreter (default python3)
source scripts/use_venv.sh
if [ ! -f models/starter-policy/config.json ]; then
  echo "== no starter policy: building it (a few minutes)"
  python scripts/build_starter_policy.py --out models/starter-policy
fi
exec python -m flows.rl_loop "$@"
