#!/usr/bin/env bash
# The walking chunk kernels and the extend conv's table rule on the GPU, in one call (under
# benchmarks/gpu_call.sh): their GPU tests first, then chunk_kernel_sweep.py --short over bench
# qwen3_next's 512- and 4096-token buckets laid out for 256 requests, each candidate checked over a
# padded table before it is timed ("a program a row": the kernels before they walked), then the
# same steps over one request's table (the floor the walk aims at). WITH_FUSED_TESTS=1 adds the
# fused GDN mixer's GPU tests of its conv, decode and verify paths; WALK_TESTS_K narrows the first tests.
set -u
: "${OUT:?OUT is the folder whose files come back}"
mkdir -p "$OUT/walk_tests"
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_gpu_linear_kernels.py \
    -k "${WALK_TESTS_K:-captured_chunk_step or chunk_extend_kernels_match_reference_at_real_dims or conv}" \
    > "$OUT/walk_tests/pytest.log" 2>&1
tail -3 "$OUT/walk_tests/pytest.log"
if [ -n "${WITH_FUSED_TESTS:-}" ]; then
    timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gpu_gdn_fused.py \
        -k "conv or verify_launches or decode_graph or decode_matches or graph_capture_and_replay_matches" \
        > "$OUT/walk_tests/pytest_gdn_fused.log" 2>&1
    tail -3 "$OUT/walk_tests/pytest_gdn_fused.log"
fi
timeout 150 python3 benchmarks/kernels/chunk_kernel_sweep.py --out "$OUT/walk_256" --short --families gdn \
    --configs "${WALK_CONFIGS:-default,a program a row,walk 1 an SM,walk 4 an SM}" --shapes 512x1,4096x1 \
    --bucket-seqs 256 2>&1 | \
    grep -v "^conv .* c[0-9]"
timeout 90 python3 benchmarks/kernels/chunk_kernel_sweep.py --out "$OUT/walk_1" --short --families gdn \
    --configs default --shapes 512x1,4096x1 --bucket-seqs 1 2>&1 | grep -v "^conv .* c[0-9]"
