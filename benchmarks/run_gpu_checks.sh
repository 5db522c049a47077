#!/usr/bin/env bash
# Every check that needs a CUDA device, in one command (a lent GPU's time is short):
#   bash benchmarks/run_gpu_checks.sh OUT_DIR
# 1. every test marked gpu (tests/test_cuda*.py, the integrations and fp16 fit on cuda);
# 2. `jem demo --smoke` and `jem doctor` on cuda;  3. benchmarks/bench_gpu.py (WRN-28-10 iteration, SGLD, memory).
# Each step has its own time limit and log in OUT_DIR, so one that hangs leaves the others' results.
set -u
out=${1:?usage: run_gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
{ nvidia-smi -L; python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"; } 2>&1 | tee "$out/machine.txt"
timeout "${TESTS_S:-240}" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" -m gpu tests \
  2>&1 | tee "$out/tests.log" | tail -40
echo "tests exit: ${PIPESTATUS[0]}"
timeout 120 jem demo --smoke --device cuda --out /tmp/jem-demo >"$out/demo.log" 2>&1; echo "demo exit: $?"; tail -5 "$out/demo.log"
timeout 60 jem doctor --device cuda >"$out/doctor.txt" 2>&1; echo "doctor exit: $?"; tail -30 "$out/doctor.txt"
if [ "${BENCH:-1}" = 1 ]; then  # BENCH=0: the tests and doctor alone (a rerun after a fix)
  timeout "${BENCH_S:-180}" python3 -m benchmarks.bench_gpu --out "$out" >"$out/bench.log" 2>&1; echo "bench exit: $?"
  tail -40 "$out/bench.log"
fi
