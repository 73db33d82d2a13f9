#!/usr/bin/env bash
# The kernel tests on the device (bench/gpu_session.sh's kernel-tests step). Their time is
# mostly Numba compiling kernels on one CPU core per process (on the H200 of 2026-11-30 the
# first 35% of them took the whole 200 s cap in one process), so the test files, largest
# first, are dealt to JOBS pytest processes that run at once (the device has 16 cores), each
# logging to a file of its own; their logs make up $OUT/pytest.log, also when the step's cap
# ends the run (the TERM trap).
#
# A kernel that faults on the hardware (an illegal or misaligned address, a launch failure)
# leaves its process's CUDA context unusable, and every later test in that process then fails
# with the same error, which would hide what the other files have to say in a short device
# session. So after such an error each test file of that process runs again in a process of
# its own (their logs one after another in $OUT/pytest_alone.log, one line per file in the
# output).
#
#   OUT=/tmp/x JOBS=4 bash bench/gpu_kernel_tests.sh tests/kernels tests/engine/test_mma_graphs.py
# (arguments: test files and folders of them)
set -u
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
JOBS=${JOBS:-4}
mkdir -p "$OUT"
work=$(mktemp -d)
STICKY='illegal memory access|illegal address|misaligned address|unspecified launch failure'
STICKY+='|CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_MISALIGNED_ADDRESS|CUDA_ERROR_LAUNCH_FAILED'

mapfile -t files < <(
  for path in "$@"; do
    if [ -d "$path" ]; then find "$path" -name 'test_*.py'; else echo "$path"; fi
  done | xargs -r ls -S
)
parts=$((${#files[@]} < JOBS ? ${#files[@]} : JOBS))
[ "$parts" -gt 0 ] || { echo "no test files in: $*"; exit 4; }

collect() {  # the parts' logs so far, one after another, into $OUT/pytest.log
  for ((i = 0; i < parts; i++)); do
    echo "=== part $i: $(tr '\n' ' ' < "$work/files_$i")"
    cat "$work/part_$i.log" 2>/dev/null
  done > "$OUT/pytest.log"
}
trap 'collect; exit 124' TERM
trap 'rm -rf "$work"' EXIT

pids=()
for ((i = 0; i < parts; i++)); do
  part=()
  for ((j = i; j < ${#files[@]}; j += parts)); do part+=("${files[j]}"); done
  printf '%s\n' "${part[@]}" > "$work/files_$i"
  "$PY" -m pytest -q -p no:cacheprovider --durations=5 --continue-on-collection-errors \
    "${part[@]}" > "$work/part_$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for ((i = 0; i < parts; i++)); do
  wait "${pids[i]}"
  code=$?
  [ "$code" -ne 0 ] && rc=$code
  codes[i]=$code
  echo "part $i: rc=$code $(tail -n 1 "$work/part_$i.log")"
done
collect

: > "$OUT/pytest_alone.log"
for ((i = 0; i < parts; i++)); do
  if [ "${codes[i]}" -ne 0 ] && grep -qE "$STICKY" "$work/part_$i.log"; then
    echo "=== part $i: a sticky CUDA error: each of its test files again in a process of its own"
    while read -r file; do
      "$PY" -m pytest -q -p no:cacheprovider "$file" > "$work/alone.log" 2>&1
      code=$?
      { echo "=== $file: rc=$code"; cat "$work/alone.log"; } >> "$OUT/pytest_alone.log"
      echo "$file: rc=$code $(tail -n 1 "$work/alone.log")"
    done < "$work/files_$i"
  fi
done
[ -s "$OUT/pytest_alone.log" ] || rm -f "$OUT/pytest_alone.log"
exit "$rc"
