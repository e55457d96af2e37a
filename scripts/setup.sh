#!/usr/bin/env bash
# Install the factory and everything its tests need on a fresh Debian machine with Python >= 3.11.
# Idempotent: a second run only checks. Set FACTORY_SKIP_APT=1 to skip Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ "${FACTORY_SKIP_APT:-0}" != "1" ] && command -v apt-get >/dev/null; then
  need=()
  # slurmctld slurmd slurm-client munge: the one-node SLURM of tests/integration/test_inference_slurm.py
  # chromium chromium-driver: the headless browser of tests/integration/test_viewer_browser.py
  # gcc: builds factory/serve/numjson.c at install time (setup.py), the batching API's native number reader (optional)
  for pkg in ${FACTORY_APT_PACKAGES-slurmctld slurmd slurm-client munge chromium chromium-driver gcc}; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

# torch first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
$PYTHON -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PYTHON -m pip install -q --disable-pip-version-check -e ".[dev]"
