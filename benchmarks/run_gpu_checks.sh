#!/usr/bin/env bash
# Every check that needs a CUDA device, in one command (a lent GPU's time is short):
#   bash benchmarks/run_gpu_checks.sh OUT_DIR
# 1. every test marked gpu (tests/test_cuda*.py, the integrations and fp16 fit on cuda);
# 2. `jem demo --smoke` and `jem doctor` on cuda;  3. benchmarks/bench_gpu.py (WRN-28-10 iteration, SGLD,
# memory) and bench_gpu_path.py --gpu-only (autocast, channels_last, compile against the eager chain).
# Each step has its own time limit, so one that hangs leaves the others' results. OUT_DIR gets seven
# files (the lending tool brings back eight at most): tests.log, demo.log, doctor.txt and the two
# benchmarks' .json and .md; the other logs stay in /tmp, their ends printed.
set -u
out=${1:?usage: run_gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi -L; python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests \
  2>&1 | tee "$out/tests.log" | tail -40
echo "tests exit: ${PIPESTATUS[0]}"
timeout 120 jem demo --smoke --device cuda --out /tmp/jem-demo >"$out/demo.log" 2>&1; echo "demo exit: $?"; tail -5 "$out/demo.log"
timeout 60 jem doctor --device cuda >"$out/doctor.txt" 2>&1; echo "doctor exit: $?"; tail -30 "$out/doctor.txt"
if [ "${BENCH:-1}" = 1 ]; then  # BENCH=0: the tests and doctor alone (a rerun after a fix)
  timeout "${BENCH_S:-180}" python3 -m benchmarks.bench_gpu --out "$out" >/tmp/bench.log 2>&1; echo "bench exit: $?"
  tail -40 /tmp/bench.log
  timeout "${BENCH_S:-180}" python3 -m benchmarks.bench_gpu_path --gpu-only --out "$out" >/tmp/gpu_path.log 2>&1
  echo "gpu_path exit: $?"; tail -20 /tmp/gpu_path.log
fi
