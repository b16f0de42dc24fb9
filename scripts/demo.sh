#!/usr/bin/env bash
# The main job on the embedded default: a local Slurm cluster and SQLite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
exec slurmguard demo "$@"
