#!/usr/bin/env bash
# One lent-GPU session's checks, in priority order, each under its own time cap so that one
# slow or hung step cannot eat the others' device time:
#   1. the machine (GPU, driver, python, torch, numba, numba-cuda);
#   2. the kernel tests on the real device (no simulator) and the CUDA-graph tests (fp16 and
#      quantized pages);
#   3. bench/kernel_launch.py (host cost per kernel launch, Numba's path vs the fast path);
#   4. bench/step_gap.py (issue "Host overhead": gap between decode forwards, 1B shape);
#   5. bench/attention_kernel.py (decode attention GB/s vs the copy bandwidth), then
#      bench/attention_keys_per_step.py (decode attention per cache mode vs keys per step),
#      bench/cache_write_kernel.py (rotary + quantized cache write per mode),
#      bench/kv_gather_kernel.py (the prompt-chunk route's context gather, kernel vs torch),
#      ncu on one decode attention call per mode (bench/attention_ncu.py), the kernels of a
#      decode forward per cache mode (bench/kv_forward_profile.py), one mixed step's attention
#      with its decode rows on CUDA cores and on tensor cores and its prompt chunk through
#      kv_gather's kernel and the torch gather (--mixed), and prefill through
#      SDPA vs the kernel (1B shape, prefill rows only);
#   6. bench/gpu_decode.py on the 1B shape (kernels with and without CUDA graphs, KV-cache
#      modes at batch 32 x 4k: issue "Quantized KV cache"), then its baselines: prefill
#      attention in the kernel (ENGINE_PREFILL_ATTENTION=kernel) and Numba's own launches
#      (ENGINE_NUMBA_LAUNCH=numba);
#   7. bench/gpu_decode.py on the 8B shape (default op set, and transformers' generate_batch
#      on the same weights; its KV rows, fp16 and q4 unless KV_MODES_8B names others, include
#      a step verifying 4 drafts per sequence through the gather route and as decode-kernel
#      rows, `verify_step_ms`: all six modes and transformers overran 240 s on 2026-11-30,
#      two modes without transformers took ~100 s), merged into the same JSON; then fp16 and
#      q4 pages with every
#      decode batch on the CUDA-core kernel (ENGINE_TENSOR_CORE_DECODE=0; by default the
#      decode batches a CUDA graph captures take the tensor-core kernel).
# Writes run.log, pytest.log and the benchmarks' JSON under $OUT (or ./gpu-out).
#
#   OUT=/tmp/x bash bench/gpu_session.sh            # on the device machine
#   DRY=1 OUT=/tmp/x bash bench/gpu_session.sh      # here: the same steps as CPU dry runs
#   STEPS="kernel-tests step-gap" ... bash bench/gpu_session.sh   # only the steps named
# The caps add up to more than one device call may run (10 minutes): split the steps over two
# calls, e.g. STEPS="machine kernel-tests keys-per-step kv-gather" then
# STEPS="cache-write mixed-profile chunk-split gpu-decode-8b" (issue "Quantized KV cache":
# stops 39-42's kernels are untimed: the pipelined sink variant, the context gather, the cache
# write; stop 50's later-chunk split on a GPU too).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
DRY=${DRY:-}
dry=${DRY:+--dry-run}
small=llama3.2-1b large=llama3-8b
[ -n "$DRY" ] && small=tiny large=tiny
log="$OUT/run.log"
start=$(date +%s)

# numba-cuda 0.30.4 registers np.row_stack, which numpy 2.5 removed; the device images of
# 2026-11-26 and 2026-11-30 paired the two, and every kernel compile then failed (a lost device
# call on 2026-11-30). Stop at once instead; the fix: a numpy<2.5 wheel for the device's Python,
# carried and installed first (docs/history.md, "First GPU runs").
if [ -z "$DRY" ] && ! "$PY" -c 'import numpy; numpy.row_stack' 2>/dev/null; then
  echo "numpy $("$PY" -c 'import numpy; print(numpy.__version__)') lacks np.row_stack, which" \
    "numba-cuda needs: install numpy<2.5 first (docs/history.md, 'First GPU runs')" | tee -a "$log"
  exit 2
fi

step() {  # step NAME CAP_SECONDS COMMAND...: run, log, and report its status and time
  local name=$1 cap=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  local t0=$(date +%s)
  echo "=== $name (cap ${cap}s) at +$((t0 - start))s" | tee -a "$log"
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $(($(date +%s) - t0))s" | tee -a "$log"
}

step machine 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
  --format=csv 2>&1; $PY -c 'import sys, torch, numba, numba_cuda; print(sys.version); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available()); \
print(\"numba\", numba.__version__, \"numba-cuda\", numba_cuda.__version__)'"

if [ -z "$DRY" ]; then
  # (the files dealt to KERNEL_JOBS pytest processes at once: Numba's compiles took a single
  # process's whole 200 s cap at 35% of the tests on 2026-11-30; after a sticky CUDA error
  # each file of that process again in its own: gpu_kernel_tests.sh. Stop 60's 4 processes
  # took 168, 182, 102 and 25 s, so 8 now: the device has 16 cores. Stop 61's op-set fuzz,
  # tests/kernels/test_cuda_op_set_fuzz.py, takes 30 seeds per test there, each new shape a
  # compile: PAGEDSERVE_FUZZ_TRIALS=N takes fewer)
  step kernel-tests "${KERNEL_CAP:-240}" env OUT="$OUT" PY="$PY" JOBS="${KERNEL_JOBS:-8}" \
    bash bench/gpu_kernel_tests.sh \
    ${TEST_PATHS:-tests/kernels tests/engine/test_decode_graphs.py tests/engine/test_quant_graphs.py tests/engine/test_mma_graphs.py}
fi

step kernel-launch "${LAUNCH_CAP:-90}" $PY bench/kernel_launch.py $dry --output "$OUT/kernel_launch.json"

step step-gap "${GAP_CAP:-90}" $PY bench/step_gap.py $dry --batches 1 64 \
  --sampling greedy topk_topp temperature --output "$OUT/step_gap.json"

if [ -z "$DRY" ]; then  # (no dry run: it writes bench/results/attention_kernel.json itself)
  step attention-kernel "${ATTENTION_CAP:-60}" bash -c "$PY bench/attention_kernel.py --iters 20 \
    && cp bench/results/attention_kernel.json $OUT/attention_kernel.json"
fi

if [ -z "$DRY" ]; then  # (GPU only) decode attention per cache mode vs keys per step
  step keys-per-step "${KEYS_CAP:-180}" $PY bench/attention_keys_per_step.py --iters 20 ${KEYS_ARGS:-} \
    --output "$OUT/attention_keys_per_step.json"
  # the rotary + cache write per cache mode (stop 39: butterfly Hadamard, a block per
  # (token, KV head): cache_write_kernel_h200_2026-11-30), its quantized modes also at blocks
  # of 64 and 256 threads (stop 54: prompt-sized writes, q4 407 us vs fp16 60 at 2048 tokens;
  # stop 60: 2 warps per block from 8 blocks per SM up, i.e. 132 tokens at 8 KV heads on an
  # H200, a guess between 32 and 2048 tokens that the middle counts here check)
  step cache-write "${WRITE_CAP:-90}" $PY bench/cache_write_kernel.py --threads auto,64,256 \
    --tokens 32,64,128,256,512,2048 \
    --output "$OUT/cache_write_kernel.json"
  # the prompt-chunk route's context gather, the kv_gather kernel (stop 42: 8 threads per
  # group, 8-byte stores) beside the torch gather, against the copy bandwidth
  step kv-gather "${GATHER_CAP:-60}" $PY bench/kv_gather_kernel.py \
    --output "$OUT/kv_gather_kernel.json"
  # the decode attention's hardware counters (ncu reads them on a Firecracker machine only),
  # then where a decode forward's GPU time goes per cache mode
  step attention-ncu "${NCU_CAP:-90}" bash -c "ncu --clock-control none --profile-from-start off \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis $PY bench/attention_ncu.py \
    > $OUT/attention_ncu.txt 2>&1; grep -E 'Duration|Issued Warp|Occupancy  |Throughput' \
    $OUT/attention_ncu.txt"
  step kv-forward-profile "${PROFILE_CAP:-120}" $PY bench/kv_forward_profile.py \
    --output "$OUT/kv_forward_profile.txt"
  # one eager mixed step's attention, its decode rows on CUDA cores and on tensor cores (why
  # the latter was slower on the H200, stop 37), q4's prompt chunk through the kv_gather
  # kernel and through the torch gather it replaced (stop 41: the host time)
  step mixed-profile "${PROFILE_CAP:-120}" $PY bench/kv_forward_profile.py --mixed \
    --modes fp16,q4 --output "$OUT/mixed_step_profile.txt"
  # later prompt chunks through CUDA's flash op, prefix and chunk apart (ENGINE_CHUNK_SPLIT=on,
  # stop 50), against the mask a GPU keeps by default: its tests, then the 8B heads' chunked
  # prompts, ragged groups and grid in float16
  step chunk-split "${SPLIT_CAP:-120}" bash -c "$PY -m pytest -q -p no:cacheprovider \
    tests/unit/test_reference_attention_groups.py -k cuda 2>&1 | tail -n 5; \
    $PY bench/chunk_mask_cpu.py --device cuda --shape llama3-8b --grid --ragged-grid \
    --output $OUT/chunk_mask_cuda.json"
fi

# prefill through SDPA (as shipped) and through the kernel, side by side, prefill rows only
step prefill-routing "${ROUTING_CAP:-120}" bash -c "$PY bench/gpu_decode.py $dry --models $small \
  --ops default --decode-batches 1 --prefill-batches 1,8 --skip-transformers \
  --output $OUT/prefill_sdpa.json && ENGINE_PREFILL_ATTENTION=kernel $PY bench/gpu_decode.py $dry \
  --models $small --ops default --decode-batches 1 --prefill-batches 1,8 --skip-transformers \
  --output $OUT/prefill_kernel.json"

# the 1B shape as shipped, then with prefill attention in the kernel (the baseline of the
# SDPA routing) and with Numba's own launches (the baseline of the fast launch path)
step gpu-decode-1b "${DECODE_1B_CAP:-90}" $PY bench/gpu_decode.py $dry \
  --models "$small" --ops default,eager --decode-batches 1,32 \
  --prefill-batches 8 --skip-transformers --output "$OUT/gpu_decode.json"

step gpu-decode-1b-prefill-kernel "${DECODE_1B_CAP:-90}" env ENGINE_PREFILL_ATTENTION=kernel \
  $PY bench/gpu_decode.py $dry --models "$small" --ops default --decode-batches 1 \
  --prefill-batches 1,8 --skip-transformers --output "$OUT/gpu_decode_prefill_kernel.json"

step gpu-decode-1b-numba "${DECODE_1B_CAP:-90}" env ENGINE_NUMBA_LAUNCH=numba \
  $PY bench/gpu_decode.py $dry --models "$small" --ops default,eager --decode-batches 1,32 \
  --prefill-batches 8 --skip-transformers --output "$OUT/gpu_decode_numba_launch.json"

# the 8B shape last, with transformers' generate_batch on the same weights (slow to build)
step gpu-decode-8b "${DECODE_8B_CAP:-150}" $PY bench/gpu_decode.py $dry \
  --models "$large" --ops default --decode-batches 1,32 \
  --prefill-batches 1 --decode-steps 32 --kv-modes "${KV_MODES_8B:-fp16,q4}" --merge \
  --output "$OUT/gpu_decode.json"

# the same 8B decode with every decode batch on the CUDA-core kernel (by default those a CUDA
# graph captures take the tensor-core kernel), fp16 and q4 pages
step gpu-decode-8b-cuda-cores "${DECODE_8B_MMA_CAP:-120}" env ENGINE_TENSOR_CORE_DECODE=0 \
  $PY bench/gpu_decode.py $dry --models "$large" --ops default --decode-batches 32 \
  --prefill-batches 1 --decode-steps 16 --skip-transformers --kv-modes fp16,q4 \
  --output "$OUT/gpu_decode_cuda_cores.json"

echo "=== done in $(($(date +%s) - start))s" | tee -a "$log"
