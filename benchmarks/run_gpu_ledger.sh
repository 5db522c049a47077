#!/usr/bin/env bash
# The benefit ledger on a lent GPU, in one command (issue 58):
#   bash benchmarks/run_gpu_ledger.sh OUT [SECONDS]
# Installs the package, then trains bench_ledger's GPU plan (--gpu: every arm, 3 seeds, resnet10t and
# wrn10-1 on textures and digits32, then convnext_atto and resnet18 on textures, to 3,000 iterations)
# on the device, WORKERS processes of THREADS torch threads sharing it; each point is evaluated on the
# CPU (the long row's evaluation and the ledger's). No cell starts after SECONDS - 40 - MARGIN
# seconds; whatever still runs at SECONDS - 40 is killed. OUT/ledger_gpu.tar.gz gets the cells'
# JSON, the evaluated points (not the models), runs.json and the log. Merge it afterwards with
#   python -m benchmarks.bench_ledger --merge-from OUT/ledger_gpu.tar.gz && python -m benchmarks.bench_ledger --report
# Environment: INSTALL (1; 0 skips the pip install), DEVICE (cuda; cpu for a smoke test), WORKERS (6),
# THREADS (2), MARGIN (60), WORK (/tmp/ledger_gpu), EXTRA (more arguments, e.g. "--tiny --iterations 2").
set -u
out=${1:?usage: run_gpu_ledger.sh OUT [SECONDS]}
total=${2:-480}
start=$(date +%s)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2}
work=${WORK:-/tmp/ledger_gpu}
mkdir -p "$work/cells" "$work/points"
log=$work/run.log
if [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
fi
nvidia-smi -L 2>/dev/null
kill_at=$((start + total - 40))
budget=$((kill_at - ${MARGIN:-60} - $(date +%s)))
echo "[$(date +%H:%M:%S)] ledger on ${DEVICE:-cuda}: ${WORKERS:-6} workers x ${THREADS:-2} threads, no cell starts after $budget s"
: >"$log"
# shellcheck disable=SC2086  # EXTRA: several arguments
setsid python3 -m benchmarks.bench_ledger --gpu --device "${DEVICE:-cuda}" --workers "${WORKERS:-6}" \
  --threads "${THREADS:-2}" --deadline-s "$budget" --out "$work" ${EXTRA:-} >"$log" 2>&1 &
pid=$!
tail -n +1 -f --pid="$pid" "$log" &
while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$kill_at" ]; do sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
  echo "[$(date +%H:%M:%S)] time is up: stopping the run (the cells keep the points they made)"
  kill -TERM -- -"$pid" 2>/dev/null; sleep 3; kill -KILL -- -"$pid" 2>/dev/null
fi
wait "$pid" 2>/dev/null; echo "run exit: $?"
files=(cells points run.log)
[ -f "$work/runs.json" ] && files+=(runs.json)
tar czf "$out/ledger_gpu.tar.gz" -C "$work" "${files[@]}"
echo "cells: $(ls "$work/cells" | wc -l), points: $(ls "$work/points" | grep -c json), done: $(grep -l '"done": true' "$work"/cells/*.json 2>/dev/null | wc -l)"
echo "[$(date +%H:%M:%S)] total $(($(date +%s) - start)) s"
