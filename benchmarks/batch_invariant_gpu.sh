#!/usr/bin/env bash
# Batch-invariant numerics (hgc compile --batch-invariant) on the GPU, in one call of
# benchmarks/gpu_call.sh:
#
#   HGC_CALL_SECONDS=560 bash benchmarks/gpu_call.sh bash benchmarks/batch_invariant_gpu.sh [STAGES]
#
# STAGES (comma-separated, default all): kernels (the GEMM, row-sum and fixed-split attention kernels' GPU
# tests: checked against their references and row invariance, before anything is timed), engine
# (tests/gpu/test_gpu_speculative.py -k batch_invariant: verify rows the decode steps' bits, greedy
# tokens with drafts plain decoding's), families (tests/gpu/test_gpu_batch_invariance.py: a decode row
# alone and among others the same bits, for the four families and with compiled pieces), gemm
# (benchmarks/kernels/gemm_invariant_bench.py: the kernel against cuBLAS), spec (benchmarks/serving/spec_bench.py
# --batch-invariant: step costs, verify against decode, greedy tokens of 32 prompts x 64 with the
# real draft), baseline (spec_bench's step costs with the default kernels: the same-call baseline
# of the step costs), lone (a lone request decoding past 256 keys, benchmarks/history/batch_invariant.md,
# second run: the GPU tests of the one-request verify bucket at 284 keys and of a long
# request's greedy text with D = 1 and 3; a verify row that parts is traced op by op), twins
# (spec_bench's verify_vs_decode alone: the twins of batch 1 at 284 keys and batch 8 up to 700,
# replayed, then eager op by op: where each row's bits first part), probe
# (benchmarks/probes/spec_text_probe.py on bench size: where a lone request's text and log-probabilities
# with drafts leave plain decoding's, and each run with the draft program against its twin without
# it; then plain and D = 3 eager, traced op by op: the first position and op where they part).
# twins and probe share one artifact. Results under $OUT, one folder per stage.
set -u
: "${OUT:?OUT is the folder whose files come back}"
stages=",${1:-kernels,engine,families,gemm,spec,baseline,lone,twins,probe},"
status=0
run() {  # run NAME COMMAND...: the stage's output to $OUT/NAME.log and the call's log
    local name=$1
    shift
    if [[ $stages == *",$name,"* ]]; then
        echo "== $name: $*"
        "$@" > "$OUT/$name.log" 2>&1
        local rc=$?
        tail -n 25 "$OUT/$name.log"
        echo "== $name: exit $rc"
        [ $rc -eq 0 ] || status=$rc
    fi
}
run kernels python3 -m pytest -q -m gpu tests/runtime/backends/test_triton_matmul.py tests/runtime/backends/test_triton_row_sum.py tests/runtime/backends/test_triton_fixed_splits.py \
    -rA -p no:cacheprovider
run engine python3 -m pytest -q -m gpu tests/gpu/test_gpu_speculative.py -k batch_invariant -p no:cacheprovider
run families python3 -m pytest -q -m gpu tests/gpu/test_gpu_batch_invariance.py -rA -p no:cacheprovider
run gemm python3 benchmarks/kernels/gemm_invariant_bench.py --out "$OUT/gemm"
run spec python3 benchmarks/serving/spec_bench.py --out "$OUT/spec" --work /tmp/spec_bi --batch-invariant --skip full_acceptance
run baseline python3 benchmarks/serving/spec_bench.py --out "$OUT/baseline" --work /tmp/spec_bi \
    --skip verify_vs_decode,full_acceptance,greedy_equal
run lone python3 -m pytest -q -m gpu tests/gpu/test_gpu_speculative.py -k "one-request-past-256-keys or long_request" \
    -rA -p no:cacheprovider
run twins python3 benchmarks/serving/spec_bench.py --out "$OUT/twins" --work /tmp/spec_probe --batch-invariant \
    --skip step_cost,full_acceptance,greedy_equal
run probe python3 benchmarks/probes/spec_text_probe.py --out "$OUT/probe" --work /tmp/spec_probe --batch-invariant \
    --trace-ops
exit $status
