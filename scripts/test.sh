#!/usr/bin/env bash
# Set up and run the whole test suite: fast unit tests first, then integration tests that start real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/use_venv.sh

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
# Every process the tests start inherits this marker; tests/process_leaks.py finds the ones that outlive them.
export FACTORY_TEST_SESSION="test-sh-$$-$(date +%s%N)"

run_pytest() {
  # pytest exits 5 when a selection holds no tests; that is not a failure here.
  set +e
  python -m pytest "$@"
  local code=$?
  set -e
  if [ $code -ne 0 ] && [ $code -ne 5 ]; then exit $code; fi
}

echo "== unit tests"
run_pytest -q -m "not integration and not slurm and not gpu and not browser" --timeout 300 tests
echo "== integration tests (real servers)"
run_pytest -q -m "integration and not gpu" --timeout 900 tests
echo "== processes left running by the tests (none expected)"
python -m tests.process_leaks "$FACTORY_TEST_SESSION"
