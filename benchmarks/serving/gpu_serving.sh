#!/usr/bin/env bash
# One GPU call: the float32 Kimi-Linear graph test (its MLA routed to the Triton kernel), then the
# serving benchmark on a bench-size checkpoint of each named family (default: qwen3_next kimi_linear).
#
#   HGC_CALL_SECONDS=560 bash benchmarks/gpu_call.sh bash benchmarks/serving/gpu_serving.sh qwen3_next kimi_linear
#
# Each family: hgc init-model (bench, seed 0), hgc compile --target cuda --dtype bfloat16 --no-inductor,
# (skipped when a warm machine still has the artifact; SKIP_TESTS=1 skips the test)
# benchmarks/serving/serve_bench.py against `hgc serve` on it; results in $OUT/serve_FAMILY/serve_bench.json.
set -u
: "${OUT:?OUT is the folder whose files come back}"
hgc() { python3 -m hgc "$@"; }
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -m gpu tests/gpu/test_gpu_graphs.py -k float32 2>&1 | tail -15
families=("$@"); [ $# -eq 0 ] && families=(qwen3_next kimi_linear)
for family in "${families[@]}"; do
    ckpt=/tmp/ckpt_$family art=/tmp/bench_$family
    echo "== $family"
    if [ ! -f "$art/manifest.json" ]; then  # a warm machine keeps /tmp between calls
        hgc init-model --family "$family" --size bench --seed 0 -o "$ckpt" || continue
        # --no-inductor: the traced glue, as the serving numbers in BENCHMARKS.md were measured
        # (benchmarks/serving/startup_bench.py measures compiled pieces)
        hgc compile "$ckpt" --target cuda --dtype bfloat16 --no-inductor -o "$art" || continue
    fi
    python3 benchmarks/serving/serve_bench.py --artifact "$art" --device cuda --out "$OUT/serve_$family"
done
