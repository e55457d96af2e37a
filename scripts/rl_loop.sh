#!/usr/bin/env bash
# The RL loop in one command (offline, CPU): the `rl-loop` Prefect flow (flows/rl_loop.py). Eval of the starter
# policy on problems training can never draw, local Prefect + policy server + batching API + InternBootcamp datagen
# (serve mode) + train-grpo until the stop rule, eval again, report in <out_dir>/report.{md,json,png}.
#   bash scripts/rl_loop.sh                              # deployments/rl_loop.yaml: 600 s of training, seed 0
#   bash scripts/rl_loop.sh --budget_s 300 --seed 1 --out_dir runs/rl-s1
#   bash scripts/rl_loop.sh --total_steps 50             # stop rule: exactly 50 steps instead of the budget
#   bash scripts/rl_loop.sh --help                       # every key, its default and what it does
# On a fresh machine it first installs the Python packages (scripts/setup.sh without Debian packages: the loop
# needs none) and builds the starter policy if models/starter-policy is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
if ! $PYTHON -c "import torch, transformers, prefect, pyarrow, matplotlib, httpx, fastapi" >/dev/null 2>&1; then
  echo "== installing the factory's Python packages (scripts/setup.sh, no Debian packages)"
  FACTORY_SKIP_APT=1 PYTHON=$PYTHON bash scripts/setup.sh
fi
if [ ! -f models/starter-policy/config.json ]; then
  echo "== no starter policy: building it (a few minutes)"
  $PYTHON scripts/build_starter_policy.py --out models/starter-policy
fi
exec $PYTHON -m flows.rl_loop "$@"
