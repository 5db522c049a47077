#!/usr/bin/env bash
# The long row's GPU part (issue 45 items 1, 4, 5) in one command, for a lent GPU's one call:
#   bash benchmarks/run_gpu_long_row.sh OUT [SECONDS]
# Installs the package, then trains bench_long_row's GPU plan (--gpu-plan: resnet18 baseline and
# jem train's choice at 10,000 iterations, the weight role (the choice at p(x) weight 0.3) on every
# network, textures then digits32, DAT on textures/ and digits32/resnet10t, then every cell
# of the CPU plan not done in benchmarks/results/long_row/cells) on the device, each point evaluated
# on the CPU, WORKERS processes of THREADS torch threads sharing the one GPU (default 6 x 2 on 16
# cores: six runs keep the GPU busy between each other's small kernels and evaluations, 12 threads
# evaluate, the rest is left to the parent, the CUDA driver and the data). No cell starts, and each
# stops at its next point, after SECONDS - 40 - MARGIN (default 60) seconds; whatever still runs at
# SECONDS - 40 is killed, and OUT/long_row_gpu.tar.gz gets every cell's JSON (the points made),
# runs.json and the log. Merge it afterwards with
#   python -m benchmarks.bench_long_row --merge-from OUT/long_row_gpu.tar.gz && python -m benchmarks.bench_long_row --report
# Environment: INSTALL (1; 0 skips the pip install), DEVICE (cuda; cpu for a smoke test of the plumbing), WORKERS, THREADS, MARGIN, WORK
# (the work dir, default /tmp/long_row_gpu), EXTRA (more bench_long_row arguments, e.g. "--tiny --limit 3").
# The judges are trained in the parent unless benchmarks/results/long_row/judges/ is there (carry it).
set -u
out=${1:?usage: run_gpu_long_row.sh OUT [SECONDS]}
total=${2:-480}
start=$(date +%s)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2}
work=${WORK:-/tmp/long_row_gpu}
mkdir -p "$work/cells"
log=$work/run.log
if [ "${INSTALL:-1}" = 1 ]; then  # INSTALL=0: use the package as installed (a shared machine's editable install)
  python3 -m pip install -q --no-deps --no-build-isolation . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
fi
nvidia-smi -L 2>/dev/null
src=benchmarks/results/long_row
[ -d "$src/judges" ] && cp -r "$src/judges" "$work/"
[ -f "$work/datasets.json" ] || cp "$src/datasets.json" "$work/" 2>/dev/null
# The judges not carried are trained here on all cores, in a process of its own (the run's parent
# stays on one thread, for the workers it forks); the CPU's judges were trained on one thread.
case " ${EXTRA:-} " in *" --tiny "*) tiny=True ;; *) tiny=False ;; esac
echo "[$(date +%H:%M:%S)] judges carried: $(ls "$work/judges" 2>/dev/null | tr '\n' ' ')"
python3 -c "import os, sys, torch; torch.set_num_threads(len(os.sched_getaffinity(0)))
from benchmarks import bench_generalisation as GB
for name in ('textures', 'digits32'): GB.judge_for(name, $tiny, sys.argv[1])" "$work"
now=$(date +%s)
kill_at=$((start + total - 40))
deadline=$((kill_at - ${MARGIN:-60}))  # an absolute time: python's imports do not move it
echo "[$(date +%H:%M:%S)] long row on ${DEVICE:-cuda}: ${WORKERS:-6} workers x ${THREADS:-2} threads, deadline in $((deadline - now)) s, kill in $((kill_at - now)) s"
: >"$log"  # there before tail follows it
# shellcheck disable=SC2086  # EXTRA: several arguments
setsid python3 -m benchmarks.bench_long_row --gpu-plan --device "${DEVICE:-cuda}" --workers "${WORKERS:-6}" \
  --threads "${THREADS:-2}" --deadline-at "$deadline" --out "$work" --no-report ${EXTRA:-} >"$log" 2>&1 &
pid=$!  # setsid: python leads its own process group, which the kill below ends with its workers
tail -n +1 -f --pid="$pid" "$log" &
while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$kill_at" ]; do sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
  echo "[$(date +%H:%M:%S)] time is up: stopping the run (the cells keep the points they made)"
  kill -TERM -- -"$pid" 2>/dev/null; sleep 3; kill -KILL -- -"$pid" 2>/dev/null
fi
wait "$pid" 2>/dev/null; echo "run exit: $?"
grep -v "point " "$log" | tail -15  # the cells' lines and any error, again
files=(cells run.log)
[ -f "$work/runs.json" ] && files+=(runs.json)
tar czf "$out/long_row_gpu.tar.gz" -C "$work" "${files[@]}"
ls -la "$out"; echo "cells: $(ls "$work/cells" 2>/dev/null | wc -l), done: $(grep -l '"done": true' "$work"/cells/*.json 2>/dev/null | wc -l)"
echo "[$(date +%H:%M:%S)] total $(($(date +%s) - start)) s"
