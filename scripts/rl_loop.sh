#!/usr/bin/env bash
# The RL loop in one command (offline, CPU): held-out eval, local Prefect + policy server + batching API +
# InternBootcamp datagen (serve mode) + train-grpo, a wall-clock budget, eval again, before/after table.
#   bash scripts/rl_loop.sh                      # the default config (deployments/rl_loop.yaml), 10-minute budget
#   bash scripts/rl_loop.sh --budget_s 120 --eval_items 200 --out_dir runs/rl-quick
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -f models/starter-policy/config.json ]; then
  echo "== no starter policy: building it (a few minutes)"
  python3 scripts/build_starter_policy.py --out models/starter-policy
fi
exec python3 -m flows.rl_loop "$@"
