#!/usr/bin/env bash
# The factory's main job on the embedded defaults: set up, bring up the local Prefect stack, serve the starter
# policy on CPU, run the intern-bootcamp-datagen deployment, print where the data is, and clean up.
#   QUICKSTART_ITEMS=1000 bash scripts/quickstart.sh   # the deployment's full 1000 problems (default here: 200)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/use_venv.sh

export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
POLICY=${FACTORY_POLICY:-models/starter-policy}
POLICY_PORT=${FACTORY_POLICY_PORT:-30000}
ITEMS=${QUICKSTART_ITEMS:-200}
STORE=${FACTORY_STORE:-./data}
RUN_ID=${QUICKSTART_RUN_ID:-intern-bootcamp}

if [ ! -f "$POLICY/config.json" ]; then
  echo "== no starter policy at $POLICY: building it (a few minutes)"
  python scripts/build_starter_policy.py --out "$POLICY"
fi

echo "== local Prefect stack"
factory-local up
eval "$(factory-local env)"
mkdir -p .factory

echo "== local CPU policy server ($POLICY on port $POLICY_PORT)"
if curl -fs "http://127.0.0.1:$POLICY_PORT/health" >/dev/null 2>&1; then
  # Another checkout's (or an earlier) server: its answers would be taken for this one's.
  echo "error: port $POLICY_PORT already serves a policy server; stop it, or set FACTORY_POLICY_PORT to a free port"
  factory-local down >/dev/null || true
  exit 1
fi
python -m factory.inference.local_server --model "$POLICY" --port "$POLICY_PORT" >.factory/policy-server.log 2>&1 &
POLICY_PID=$!
cleanup() {
  kill "$POLICY_PID" 2>/dev/null || true
  wait "$POLICY_PID" 2>/dev/null || true
  factory-local down >/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 1 240); do
  curl -fs "http://127.0.0.1:$POLICY_PORT/health" >/dev/null 2>&1 && break
  kill -0 "$POLICY_PID" 2>/dev/null || { echo "policy server died; see .factory/policy-server.log"; exit 1; }
  sleep 0.5
done

echo "== deploy and run intern-bootcamp-datagen ($ITEMS problems x 16 responses)"
if ! python -m prefect --no-prompt deploy --name intern-bootcamp-datagen >.factory/deploy.log 2>&1; then
  cat .factory/deploy.log
  echo "error: prefect deploy failed (output above, also in .factory/deploy.log)"
  exit 1
fi
PARAMS=$(printf '{"env": {"total_items": %d, "tokenizer_name": "%s"}, "openai": {"base_url": "http://127.0.0.1:%d"}, "datagen": {"store_root": "%s", "run_id": "%s"}}' \
  "$ITEMS" "$POLICY" "$POLICY_PORT" "$STORE" "$RUN_ID")
if ! python -m prefect deployment run intern-bootcamp-datagen/intern-bootcamp-datagen --params "$PARAMS" \
    >.factory/run.log 2>&1; then
  cat .factory/run.log
  echo "error: prefect deployment run failed (output above)"
  exit 1
fi
FLOW_RUN_ID=$(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' .factory/run.log | head -1)
echo "flow run: ${PREFECT_API_URL%/api}/runs/flow-run/$FLOW_RUN_ID (progress and summary artifacts there)"
# Progress lines (chunks, groups kept, rollouts/s, ETA) until the run ends; non-zero unless it Completed.
python -m factory.progress watch "$FLOW_RUN_ID"

echo "== done"
python - "$STORE" "$RUN_ID" <<'PY'
import json, sys
from pathlib import Path
from factory.store import ShardStore
store, run = ShardStore(sys.argv[1]), sys.argv[2]
stats = json.loads((store.run_dir(run) / "stats-intern-bootcamp.json").read_text())
print(f"groups: {store.count(run)} in {len(store.shard_paths(run))} shards under {store.shards_dir(run).resolve()}")
print(f"kept {stats['groups_kept']}, dropped {stats['dropped']}, mean score {stats['mean_score']}, "
      f"{stats['session_rollouts_per_s']} rollouts/s this session")
print(f"read them: polars.scan_parquet('{store.shards_dir(run)}/*.parquet')  (rerun: committed chunks are skipped)")
PY
