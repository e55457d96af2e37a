# Sourced (not run) by scripts/*.sh from the checkout's root, after scripts/setup.sh made ./.venv: every `python`,
# `prefect`, `run-api`, `factory-local` ... they start by name, and what those start in turn (the Prefect worker's
# flow runs, SLURM batch jobs, which inherit PATH by default) is this checkout's .venv, not the system's.
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
unset PYTHONHOME
hash -r
