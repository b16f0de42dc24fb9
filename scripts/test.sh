#!/usr/bin/env bash
# The whole test suite: C tests, static checks (ruff, mypy), the wheel install check, then
# every pytest tier (unit, real Slurm, real PostgreSQL).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
if [ -f spank_plugin/Makefile ]; then
  make -s -C spank_plugin test
fi
# static checks first (configuration in pyproject.toml): lint, formatting, types
python -m ruff check .
python -m ruff format --check .
python -m mypy
# a normal (wheel) install outside the checkout runs db upgrade and renders sweeps
bash scripts/check_wheel.sh
# the slowest tests are named in the log, so a slower CI can be traced to them
exec python -m pytest -q -p no:cacheprovider --durations=40 "$@"
