#!/usr/bin/env bash
# Decode's projections as one GEMV launch inside the compiled glue (issue 50), in one GPU call:
#
#   bash benchmarks/gpu_call.sh bash benchmarks/gpu_gemv_glue.sh     (carry .whl and .jitcache_parts)
#
# 1. tests: tests/gpu/test_gpu_glue_gemv.py (the op's CUDA kernel runs the GEMV on CONFIGS shapes; a
#    compiled piece calls it and its CUDA graph replays its eager bits), log under $OUT/tests;
# 2. build: bench qwen3_next with its compiled bundle (gpu_measure.sh's build stage, PIECES=1), into a
#    work folder of its own (/tmp/measure_work may hold a bundle built before the op existed), and
#    what `hgc inspect` says of its projections;
# 3. account: benchmarks/kernels/step_account.py on that bundle at decode batch 1 and extend 32, with the
#    GEMV ($OUT/account_gemv) and with --torch-projections, the same pieces on F.linear ($OUT/account_torch);
# 4. a table of step ms and kernels per step, GEMV against torch ($OUT/gemv_glue.md);
# 5. bundle_test: the cuda-bundle check of tests/gpu/test_gpu_inductor.py (tiny qwen3_next; the bundle's
#    pieces call the op), in whatever time the call has left.
# Time: the build about 230 s cold (benchmarks/results/build_one_call_h200_2026-12-03.log: compile 48 s,
# bundle 174 s; a warm machine that kept $W skips it), the tests and each account under a minute.
# STAGES picks stages (default "tests build account table bundle_test").
set -u
: "${OUT:?OUT is the folder whose files come back}"
export W=${W:-/tmp/gemv_glue_work}
ART=$W/qwen3_next-bench-art-compiled  # bench_common.compiled_artifact's name for it
STAGES=${STAGES:-tests build account table bundle_test}
status=0

for stage in $STAGES; do
    echo "== $stage $(date +%T) (${SECONDS} s in)"
    case $stage in
    tests)
        mkdir -p "$OUT/tests"
        timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gpu_glue_gemv.py > "$OUT/tests/glue_gemv.log" 2>&1 ||
            status=1
        tail -4 "$OUT/tests/glue_gemv.log" ;;
    build)
        PIECES=1 FAMILIES=qwen3_next bash benchmarks/gpu_measure.sh build
        [ -f "$ART/manifest.json" ] || { echo "no artifact at $ART"; status=1; break; }
        python3 -m hgc inspect "$ART" --json > "$OUT/inspect.json" &&
            python3 -c "import json; print('bundles:', json.load(open('$OUT/inspect.json'))['bundles'])" ;;
    account)
        for side in gemv torch; do
            flag=(); [ "$side" = torch ] && flag=(--torch-projections)
            timeout 150 python3 benchmarks/kernels/step_account.py --out "$OUT/account_$side" --work "$W" \
                --compiled-pieces --batches 1 --extends 32 "${flag[@]}" > "$OUT/account_$side.log" 2>&1 || status=1
            grep -E "^  (decode|extend)|Error|error:" "$OUT/account_$side.log" | head -8
        done ;;
    table)
        python3 - "$OUT" <<'EOF' | tee "$OUT/gemv_glue.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
docs = {side: json.loads((out / f"account_{side}" / "step_account.json").read_text())["families"]["qwen3_next"]
        for side in ("gemv", "torch") if (out / f"account_{side}" / "step_account.json").is_file()}
print(f"bench qwen3_next, compiled bundle (GEMV projections in bundle.json: "
      f"{docs.get('gemv', {}).get('gemv_projections')})\n")
print("| step | GEMV ms | torch ms | GEMV / torch | GEMV kernels | torch kernels |")
print("|---|---:|---:|---:|---:|---:|")
for mode, key in (("decode", "1"), ("extend", "32")):
    rec = {side: doc.get(mode, {}).get(key) for side, doc in docs.items()}
    if not all(rec.get(side) for side in ("gemv", "torch")):
        print(f"| {mode} {key} | missing: {[s for s in ('gemv', 'torch') if not rec.get(s)]} | | | | |")
        continue
    g, t = rec["gemv"], rec["torch"]
    print(f"| {mode} {'B' if mode == 'decode' else 'T'}={key} | {g['step_ms']:.3f} | {t['step_ms']:.3f} | "
          f"{g['step_ms'] / t['step_ms']:.3f} | {g['kernels_per_step']} | {t['kernels_per_step']} |")
EOF
        ;;
    bundle_test)
        mkdir -p "$OUT/tests"
        python3 -m pytest -q -m gpu -k qwen3_next \
            tests/gpu/test_gpu_inductor.py::test_compile_with_inductor_builds_the_bundle_on_cuda \
            > "$OUT/tests/bundle.log" 2>&1 || status=1
        tail -4 "$OUT/tests/bundle.log" ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
echo "== done $(date +%T) (${SECONDS} s)"
exit $status
