#!/usr/bin/env bash
# Install everything slurmguard needs on Debian 12, as root. Safe to re-run.
#   - Debian packages: Slurm (slurmctld, slurmd, client, headers, slurmrestd and
#     the JWT plugin for the REST backend), munge,
#     PostgreSQL 15 (tests), a C toolchain, Python venv support, Chromium (report test).
#   - A virtual environment in .venv with slurmguard and its Python dependencies, and the
#     development tools (dev/: the local cluster, demo, benchmarks) that the tests and the
#     demo use; a node or controller install takes the product only (pip install .).
#   - The SPANK plugin and NCCL hook (spank_plugin/build/).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: run as root (it installs Debian packages and runs a local Slurm cluster)" >&2
  exit 2
fi

APT_PACKAGES=(
  slurmctld slurmd slurm-client munge libslurm-dev slurm-wlm-plugins-dev
  slurmrestd slurm-wlm-jwt-plugin
  postgresql-15 gcc make python3 python3-venv python3-dev
  chromium fonts-dejavu-core
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install.sh: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The packaged daemons must not run on their own: slurmguard starts private ones.
for svc in slurmctld slurmd slurmrestd munge postgresql; do
  systemctl disable --now "$svc" >/dev/null 2>&1 || true
done

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The tests cover every command, so every extra (a compute node needs only torch, for sweeps).
# torch is pinned so a machine with the CPU wheel on disk uses it; elsewhere PyPI serves it.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,torch,plan,whatif]" "torch==2.13.0" \
  2>&1 | grep -v "^WARNING: Location" || true
# the development tools: their own distribution (never in the product's wheel); they
# add `slurmguard bench|devcluster|demo`
.venv/bin/python -m pip install -q --disable-pip-version-check -e ./dev \
  2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import slurmguard, slurmguard_dev, torch, sqlalchemy, psycopg" \
  || { echo "install.sh: Python dependencies did not install" >&2; exit 1; }

if [ -f spank_plugin/Makefile ]; then
  make -s -C spank_plugin
fi
echo "install.sh: ok ($(.venv/bin/python --version), slurm $(dpkg-query -W -f='${Version}' slurm-client))"
