#!/usr/bin/env bash
# run_real.sh OUT_DIR - issue 16 item 5 on a GPU machine with torch (NCCL
# backend), gcc and make; no Slurm, no network. From a source checkout:
#
#   spank_plugin/gpu/run_real.sh /tmp/gpu-out
#
# 1. versions (driver, torch, CUDA, NCCL) and the libnccl.so.2 / CUDA
#    runtime torch loads; `make gpu` against them (hook, profiler plugin,
#    bench_hook_real);
# 2. hook: real_nccl.py under LD_PRELOAD=libslurmguard_nccl.so with CUDA
#    events, compared with torch.cuda.Event timings of the same calls;
# 3. profiler plugin alone (NCCL_PROFILER_PLUGIN), NCCL's log kept to show
#    the interface version NCCL took; compared the same way;
# 4. hook and plugin together: the plugin records, the hook defers;
#    also the hook with host timing only, and under CUDA graph capture;
# 5. slurmguard bench hook --real-cuda: cost per call, host-only timing vs
#    CUDA events, against no hook, interleaved.
# Everything lands in OUT_DIR: log.txt, and rings.tar.gz (rings + torch's
# timings per run, the recorded fixtures of tests/data/gpu/).
set -uo pipefail
mkdir -p "$1"
out=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d /tmp/sg-gpu.XXXXXX)
status=0

step() { echo; echo "== $* ($(date +%T))"; }
fail() { echo "FAILED: $*"; status=1; }

exec > >(tee "$out/log.txt") 2>&1

step versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
uname -r
gcc --version | head -1
eval "$($PY - <<'EOF'
import torch
torch.zeros(1, device="cuda")
libs = {l.split()[-1] for l in open("/proc/self/maps") if ".so" in l}
nccl = sorted(p for p in libs if "/libnccl.so" in p)
cudart = sorted(p for p in libs if "/libcudart.so" in p)
import os, sys
print(f"echo torch {torch.__version__} cuda {torch.version.cuda} "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))} "
      f"device '{torch.cuda.get_device_name(0)}'", file=sys.stdout)
print(f"NCCL_SO={nccl[0]}" if nccl else "NCCL_SO=")
print(f"CUDART={cudart[0]}" if cudart else "CUDART=")
EOF
)"
echo "libnccl: $NCCL_SO"
echo "cudart:  $CUDART"
[ -n "$NCCL_SO" ] && [ -n "$CUDART" ] || { fail "torch loaded no libnccl / libcudart"; exit 1; }
NCCL_LIB=$(dirname "$NCCL_SO")
[ -e "$NCCL_LIB/libnccl.so.2" ] || { fail "$NCCL_LIB has no libnccl.so.2"; exit 1; }

step "make gpu"
make -C "$root/spank_plugin" -s gpu NCCL_LIB="$NCCL_LIB" CUDART="$CUDART" || { fail make; exit 1; }
hook=$root/spank_plugin/build/libslurmguard_nccl.so
prof=$root/spank_plugin/build/libslurmguard_nccl_profiler.so

export SLURMGUARD_RING_RECORDS=1024 SLURMGUARD_JOB_ID=16 SLURMGUARD_STEP_ID=0
# run NAME MODE ENV...: real_nccl.py MODE in a fresh ring directory
run() {
	local name=$1 mode=$2; shift 2
	mkdir -p "$work/$name"
	step "$name: $*"
	env "$@" SLURMGUARD_RING_DIR="$work/$name" NCCL_DEBUG=INFO SLURMGUARD_PROFILER_DEBUG=1 \
		NCCL_DEBUG_FILE="$work/$name/nccl.%p.log" \
		timeout 300 $PY "$here/real_nccl.py" "$mode" "$work/$name/$mode.json" || fail "$name"
	ls -l "$work/$name"
}
# ops (and GPU flags) per ring
census() {
	$PY "$here/census.py" "$@"
}

run hook calls LD_PRELOAD="$hook"
$PY "$here/real_nccl.py" compare "$work/hook" "$work/hook/calls.json" --source nccl ||
	fail "hook: GPU durations"

run hostonly calls LD_PRELOAD="$hook" SLURMGUARD_CUDA_EVENTS=0

run graph graph LD_PRELOAD="$hook"
cat "$work/graph/graph.json"

run profiler calls NCCL_PROFILER_PLUGIN="$prof"
grep -hi "profiler" "$work"/profiler/nccl.*.log | head -20
$PY "$here/real_nccl.py" compare "$work/profiler" "$work/profiler/calls.json" --source ncclprof ||
	fail "profiler: GPU durations"

run both calls LD_PRELOAD="$hook" NCCL_PROFILER_PLUGIN="$prof"

step "records per ring"
census "$work/hook" "$work/hostonly" "$work/graph" "$work/profiler" "$work/both"

step "ring dumps"
for d in hook hostonly graph profiler both; do
	for f in "$work/$d"/*.ring; do
		[ -e "$f" ] && $PY -m slurmguard.cli ring dump "$f" > "${f%.ring}.jsonl"
	done
done

step "bench hook --real-cuda"
$PY -m slurmguard.cli bench hook --real-cuda "$NCCL_LIB" "$CUDART" --gpu-calls 20000 \
	--rounds 3 --repeats 5 --json > "$work/bench.json" || fail bench
cat "$work/bench.json"
$PY - "$work/bench.json" <<'EOF'
import json, sys
g = json.load(open(sys.argv[1]))["nccl_gpu_events"]
for k in ("base", "host", "events", "reference"):
    print(f"{k:7} wall {g['wall_ns'][k]:8.1f} ns/call  thread CPU {g['cpu_ns'][k]:8.1f} ns/call")
print(f"events over host-only: {g['added_ns']:.0f} ns wall, {g['added_cpu_ns']:.0f} ns CPU; "
      f"{g['step_pct']:.3f}% of a 50 ms step with 100 collectives")
EOF

step "pack"
rm -f "$work"/*/*.so
tar -C "$work" -czf "$out/rings.tar.gz" . && ls -l "$out"
echo "status $status"
exit $status
