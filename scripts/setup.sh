#!/usr/bin/env bash
# Install the factory and everything its tests need on a fresh Debian machine with Python 3.11: Debian packages,
# then the project's own virtualenv ./.venv (per checkout, gitignored) from the lockfile uv.lock with uv.
# Idempotent: a second run only checks. Set FACTORY_SKIP_APT=1 to skip Debian packages.
# Use the venv: `source .venv/bin/activate`, or scripts/*.sh, which put .venv/bin first on PATH themselves.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ "${FACTORY_SKIP_APT:-0}" != "1" ] && command -v apt-get >/dev/null; then
  need=()
  # slurmctld slurmd slurm-client munge: the one-node SLURM of tests/integration/test_inference_slurm.py
  # chromium chromium-driver: the headless browser of tests/integration/test_viewer_browser.py
  # gcc: builds factory/serve/numjson.c and factory/group_arrays.c at install time (setup.py; both optional)
  # valgrind: bench/datagen/instructions.py counts a datagen worker's instructions per group with callgrind
  for pkg in ${FACTORY_APT_PACKAGES-slurmctld slurmd slurm-client munge chromium chromium-driver gcc valgrind}; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

# uv itself, pinned, in a small virtualenv of its own (nothing goes into the system interpreter).
UV_VERSION=0.13.9
UV=.venv-uv/bin/uv
if [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  rm -rf .venv-uv
  $PYTHON -m venv .venv-uv
  .venv-uv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi

# The project's venv, exactly as locked (--locked: refuse a uv.lock that pyproject.toml no longer matches; run
# `.venv-uv/bin/uv lock` after editing dependencies). torch==2.13.0 is the CPU wheel on this machine's disk
# (/opt/wheels, pip's find-links; pyproject.toml's [tool.uv.sources]): PyPI's is a multi-GB CUDA build.
# The project itself is installed editable into .venv, so .venv runs this checkout's code, not another's.
# --compile-bytecode: as pip does; otherwise the first import of each module in a fresh venv (CI: every run) compiles
# it, and the tests that time a command's start-up see that.
TORCH_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
if [ ! -f "$TORCH_WHEEL" ]; then
  echo "error: $TORCH_WHEEL (torch 2.13.0 CPU) is missing; put that wheel there, or change [tool.uv.sources] torch in pyproject.toml and run .venv-uv/bin/uv lock" >&2
  exit 1
fi
UV_PYTHON_DOWNLOADS=never "$UV" sync --quiet --locked --extra dev --compile-bytecode \
  --python "$($PYTHON -c 'import sys; print(sys.executable)')"
