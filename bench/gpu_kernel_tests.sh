#!/usr/bin/env bash
# The kernel tests on the device (bench/gpu_session.sh's kernel-tests step), in one pytest
# process. A kernel that faults on the hardware (an illegal or misaligned address, a launch
# failure) leaves the process's CUDA context unusable, and every later test in that process
# then fails with the same error, which would hide what the other files have to say in a
# short device session. So after such an error each test file runs again in a process of its
# own (pytest_<file>.log each, one line per file in the output).
#
#   OUT=/tmp/x bash bench/gpu_kernel_tests.sh tests/kernels tests/engine/test_mma_graphs.py
set -u
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
STICKY='illegal memory access|illegal address|misaligned address|unspecified launch failure'
STICKY+='|CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_MISALIGNED_ADDRESS|CUDA_ERROR_LAUNCH_FAILED'

"$PY" -m pytest -q -p no:cacheprovider --durations=15 --continue-on-collection-errors "$@" 2>&1 \
  | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && grep -qE "$STICKY" "$OUT/pytest.log"; then
  echo "=== a sticky CUDA error: each test file again in a process of its own"
  for path in "$@"; do
    find "$path" -name 'test_*.py' | sort | while read -r file; do
      name=$(basename "$file" .py)
      "$PY" -m pytest -q -p no:cacheprovider "$file" > "$OUT/pytest_$name.log" 2>&1
      echo "$file: rc=$? $(tail -n 1 "$OUT/pytest_$name.log")"
    done
  done
fi
exit "$rc"
