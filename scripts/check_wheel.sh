#!/usr/bin/env bash
# A normal install works: build the wheel, install it (not editable) into a fresh venv
# outside the checkout, and from there run `slurmguard db upgrade` on a new SQLite
# database, render both sweep templates and run the installed prolog. Fails if the installed copy misses a
# runtime file or imports the checkout. The product's wheel must hold the product only: no
# development tools (dev/, slurmguard-dev), whose commands it must then name with how to install
# them; the dev wheel, installed beside it, must add them back. Takes ~25 s; run by scripts/test.sh.
#
# Offline: the wheel builds with the project's setuptools (--no-build-isolation) and
# the venv gets no dependencies of its own; a .pth appends a folder of links to the
# project venv's site-packages without slurmguard's own entries (a plain directory: its
# .pth files are not processed from there), so only the wheels provide slurmguard.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
PY=${PYTHON:-$PWD/.venv/bin/python}
work=$(mktemp -d /tmp/sg-wheel-XXXXXX)
trap 'rm -rf "$work"' EXIT

# Build from a copy: setuptools stages into ./build, where files of an earlier build
# that are gone from the tree would still end up in the wheel.
mkdir "$work/src"
cp -a pyproject.toml README.md slurmguard sql sweeps prolog_epilog "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check \
  -w "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; echo "check_wheel: building the wheel failed" >&2; exit 1; }
wheel=$(ls "$work"/dist/slurmguard-0*.whl)
# the product only: no dev package, no benchmark, dev cluster, demo or fault injection module
devfiles=$("$PY" -c 'import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "slurmguard/cli.py" in names, "not the product wheel"
dev = re.compile(r"(^slurmguard_dev/|/bench[.]py$|/scale_(bench|harness)[.]py$|/devcluster/|"
                 r"^slurmguard/demo[.]py$|/inject[.]py$|devreboot|sweepfaults)")
print("\n".join(n for n in names if dev.search(n)))' "$wheel")
if [ -n "$devfiles" ]; then
  echo "check_wheel: the product's wheel carries development tooling:" >&2
  echo "$devfiles" >&2; exit 1
fi

"$PY" -m venv --without-pip "$work/venv"
vpy="$work/venv/bin/python"
# pip runs from the project venv but installs for (and writes shebangs of) the new one
"$PY" -m pip --python "$vpy" install -q --no-deps --disable-pip-version-check "$wheel"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# The dependencies only: a folder of links to the project venvs' site-packages entries less
# slurmguard's own (its editable installs, the dev tools' metadata), so this venv sees what
# the two wheels install and nothing of the checkout
mkdir "$work/deps"
"$PY" -c 'import os, sys
deps = sys.argv[1]
for p in sys.path:
    if not p.endswith(("site-packages", "dist-packages")) or not os.path.isdir(p):
        continue
    for name in os.listdir(p):
        if "slurmguard" in name or os.path.exists(os.path.join(deps, name)):
            continue
        os.symlink(os.path.join(p, name), os.path.join(deps, name))' "$work/deps"
echo "$work/deps" >"$site/zz-slurmguard-deps.pth"

cd /tmp
unset PYTHONPATH PYTHONHOME SLURMGUARD_MIGRATIONS SLURMGUARD_POLICY SLURMGUARD_DB
"$vpy" - "$work/venv" <<'EOF'
import sys
from pathlib import Path

import slurmguard
from slurmguard import datafiles

venv = Path(sys.argv[1]).resolve()
where = Path(slurmguard.__file__).resolve()
if venv not in where.parents:
    sys.exit(f"check_wheel: slurmguard imported from {where}, not from the installed wheel in {venv}")
for name, path in (("migrations", datafiles.migrations_dir() / "env.py"),
                   ("sweeps", datafiles.sweep_dir() / "node_sweep.py"),
                   ("prolog", datafiles.prolog_epilog_dir() / "slurmguard-prolog"),
                   ("torch hook", datafiles.torch_hook_site() / "sitecustomize.py")):
    if venv not in path.parents or not path.is_file():
        sys.exit(f"check_wheel: {name}: {path} is not a file of the installed wheel")
EOF
"$work/venv/bin/slurmguard" --db "sqlite:///$work/db/sg.db" db upgrade
"$work/venv/bin/slurmguard" triage schema >/dev/null  # the report's JSON schema (package data)
for kind in node pair; do
  nodes=n1; [ "$kind" = pair ] && nodes=n1,n2
  script=$("$work/venv/bin/slurmguard" sweep render --kind "$kind" --nodes "$nodes" \
    --out "$work/out.json" --log "$work/out.log" --small)
  case $script in
  *"$work/venv/"*"/slurmguard/_data/sweeps/${kind}_sweep.py"*) ;;
  *) echo "check_wheel: the $kind sweep script does not run the installed workload:" >&2
     echo "$script" >&2; exit 1 ;;
  esac
done
# the installed prolog as slurmd starts it (no PATH, no env file, no SLURMGUARD_PYTHON):
# it must find the venv it was installed into and pass on a node with no GPU, one IB port
prolog="$site/slurmguard/_data/prolog_epilog/slurmguard-prolog"
port="$work/ib/mlx5_0/ports/1"
mkdir -p "$port/counters" "$port/hw_counters"
printf '4: ACTIVE\n' >"$port/state"
printf '5: LinkUp\n' >"$port/phys_state"
printf '400 Gb/sec (4X NDR)\n' >"$port/rate"
printf 'InfiniBand\n' >"$port/link_layer"
for c in port_xmit_data port_rcv_data symbol_error link_downed port_xmit_wait; do
  echo 0 >"$port/counters/$c"
done
printf 'prolog:\n  expected_gpus: 0\n  ib_sysfs_root: %s\n' "$work/ib" >"$work/policy.yaml"
out=$(env -i SLURMD_NODENAME=n1 SLURMGUARD_ENV_FILE=/nonexistent SLURMGUARD_POLICY="$work/policy.yaml" \
  "$prolog" -v 2>&1) || { echo "check_wheel: the installed prolog failed: $out" >&2; exit 1; }
case $out in
*"nic_link: ok"*) ;;
*) echo "check_wheel: the installed prolog did not run its checks: $out" >&2; exit 1 ;;
esac
# without the development tools their commands say how to get them (exit 2, no traceback)
for cmd in bench devcluster demo; do
  if out=$("$work/venv/bin/slurmguard" "$cmd" --help 2>&1); then
    echo "check_wheel: 'slurmguard $cmd' ran without the development tools installed: $out" >&2; exit 1
  fi
  case $out in
  *"comes with slurmguard-dev, which is not installed"*"pip install ./dev"*) ;;
  *) echo "check_wheel: 'slurmguard $cmd' without slurmguard-dev: $out" >&2; exit 1 ;;
  esac
done
# the dev tools' own wheel, installed beside it, adds them back through the entry points
cp -a "$src/dev" "$work/devsrc"
find "$work/devsrc" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$work/devsrc/build" "$work/devsrc"/*.egg-info
"$PY" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check \
  -w "$work/devdist" "$work/devsrc" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; echo "check_wheel: building the dev wheel failed" >&2; exit 1; }
"$PY" -m pip --python "$vpy" install -q --no-deps --disable-pip-version-check "$work"/devdist/slurmguard_dev-*.whl
for cmd in bench devcluster demo; do
  "$work/venv/bin/slurmguard" "$cmd" --help >/dev/null \
    || { echo "check_wheel: 'slurmguard $cmd' does not run with slurmguard-dev installed" >&2; exit 1; }
done
"$vpy" -c 'import sys, slurmguard_dev
if sys.argv[1] not in slurmguard_dev.__file__:
    sys.exit(f"check_wheel: slurmguard_dev imported from {slurmguard_dev.__file__}, not the dev wheel")' "$work/venv"
echo "check_wheel: ok ($(basename "$wheel") installed outside the checkout: db upgrade, sweep render," \
  "prolog; no development tooling in it; the slurmguard-dev wheel adds bench, devcluster, demo)"
