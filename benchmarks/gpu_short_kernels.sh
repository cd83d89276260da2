#!/usr/bin/env bash
# The kernels of a short extend step on the GPU, checked then timed (issue 49), in one call:
#
#   HGC_CALL_SECONDS=540 bash benchmarks/gpu_call.sh bash benchmarks/gpu_short_kernels.sh
#
# 1. tests: the GPU tests of the linear kernels (chunk lengths of short steps, the extend conv, the
#    decode kernels on the shared conv and decay steps, short recurrent extends captured), the fused
#    GDN op, the MoE's one-launch routing and sort, whole-step extend graphs (qwen3_next, kimi_linear)
#    and MLA's varlen kernel (STAGES=tests only, or any subset of "tests tune sweep long moe_ab");
# 2. tune: tune_moe.py over the small buckets (writes $OUT/tune/moe_configs/*.json; install it with
#    tune_moe.py --install);
# 3. sweep: chunk_kernel_sweep.py --short at the buckets' request rows and at one request row (the
#    gap is what the buckets' empty programs cost), and the long shapes' --quick run beside them;
# 4. moe_ab: gpu_moe.py, the one-launch routing and sort against two, alone and in the whole op.
set -u
: "${OUT:?OUT is the folder whose files come back}"
STAGES=${STAGES:-tests tune sweep moe_ab}
for stage in $STAGES; do
    echo "== $stage $(date +%T)"
    case $stage in
    tests)
        mkdir -p "$OUT/tests"
        python3 -m pytest -q -m gpu tests/gpu/test_gpu_linear_kernels.py tests/gpu/test_gpu_gdn_fused.py \
            tests/gpu/test_gpu_fusion.py -k "short or captured_chunk or chunk_extend_kernels or conv_extend or \
kernels_match_reference or gdn_fused or fusion or fused or short_extend_graph" > "$OUT/tests/linear.log" 2>&1
        tail -4 "$OUT/tests/linear.log"
        python3 -m pytest -q -m gpu tests/gpu/test_gpu_moe.py -k "route_sort or router_ids or sort_tokens or \
fused_moe_is or captured_graph or matches_reference" > "$OUT/tests/moe.log" 2>&1
        tail -4 "$OUT/tests/moe.log"
        python3 -m pytest -q -m gpu tests/gpu/test_gpu_mla_extend_graphs.py tests/gpu/test_gpu_extend_graphs.py \
            > "$OUT/tests/graphs.log" 2>&1
        tail -4 "$OUT/tests/graphs.log"
        python3 -m pytest -q -m gpu tests/gpu/test_gpu_attention.py -k varlen > "$OUT/tests/attention.log" 2>&1
        tail -4 "$OUT/tests/attention.log" ;;
    tune)
        python3 benchmarks/kernels/tune_moe.py --out "$OUT/tune" --shapes e16 --buckets 8,16,32,64,128 \
            --budget-s "${TUNE_S:-150}" 2>&1 | tail -15 ;;
    sweep)
        python3 benchmarks/kernels/chunk_kernel_sweep.py --out "$OUT/short" --short --families gdn --budget-s 90 2>&1 | tail -30
        python3 benchmarks/kernels/chunk_kernel_sweep.py --out "$OUT/short1" --short --families gdn --bucket-seqs 1 \
            --budget-s 60 2>&1 | tail -20 ;;
    long)
        python3 benchmarks/kernels/chunk_kernel_sweep.py --out "$OUT/long" --quick 2>&1 | tail -20 ;;
    moe_ab)
        python3 benchmarks/kernels/gpu_moe.py --out "$OUT/moe_ab" --shapes e16 --tokens 8,32,64,128 --skip-tests \
            --skip-loop 2>&1 | tail -30 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
