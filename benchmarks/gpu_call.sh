#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, keep kernel builds in .jitcache
# (carried in, packed back out), run the given command under a time bound, log it under $OUT.
#
#   bash benchmarks/gpu_call.sh python3 benchmarks/serving/gpu_graphs.py --out $OUT --sizes small-hd64
#   (carry: .whl and, once a call has packed it and `python benchmarks/jit_cache.py stash FILES_AT` has
#    run here, .jitcache_parts)
#
# .whl holds the wheels of what the GPU machine lacks (FlashInfer, FLA). Tests and benchmarks that
# start `hgc serve` there also need the server's wheels; add them to it once with
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl fastapi uvicorn httpx
#
# The command gets HGC_CALL_SECONDS (default 500) seconds, so the cache is packed before the
# call's own limit cuts everything off. Exit status: the command's (124 when it ran out of time).
set -u
: "${OUT:?OUT is the folder whose files come back}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Bytecode, as an installed copy has it. The machine's torch has no .pyc files and the environment
# sets PYTHONDONTWRITEBYTECODE, and --no-compile above leaves the carried packages without any too:
# every fresh process (each start-up a benchmark times) would compile the sources of torch, sympy,
# FLA and FlashInfer again, about 6 s of a measured start-up that no installed copy pays. Bytecode
# goes to a folder of its own (the installed trees may be read-only), written by the first process
# that imports a module (a benchmark's build step) and read by every later one.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1 || echo "compileall of /tmp/site failed (start-ups pay for source compiles)"
mkdir -p .jitcache
[ -d .jitcache_parts ] && python3 benchmarks/jit_cache.py unpack .jitcache_parts
# TRITON_CACHE_AUTOTUNING: autotuned kernels (FLA's) keep their choice in the cache too, so a
# warm cache skips the benchmarking of every config, not only the builds.
export FLASHINFER_WORKSPACE_BASE=$PWD/.jitcache TRITON_CACHE_DIR=$PWD/.jitcache/triton TRITON_CACHE_AUTOTUNING=1
# hgc build's folders, and the Triton kernels and FlashInfer modules it keeps for the next build of a target
# (hgc/kernel_seed.py, flashinfer_seed.py), under the cache too: a later call's build reads them (kernel files name
# the folder's path, the checkout's: where a later call's checkout lies elsewhere, Triton compiles anew)
export HGC_HOME=$PWD/.jitcache/hgc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/call.log"
timeout "${HGC_CALL_SECONDS:-500}" "$@" 2>&1 | tee -a "$OUT/call.log"
rc=${PIPESTATUS[0]}
# A call brings back at most 8 files and the cache's parts below take up to two: past five files the
# command's travel as one archive (`tar xzf results.tgz` where they came back), the log beside it.
if [ "$(find "$OUT" -type f | wc -l)" -gt 5 ]; then
    (cd "$OUT" && tar czf /tmp/results.tgz --exclude=./call.log . && find . -mindepth 1 ! -name call.log -delete &&
        mv /tmp/results.tgz results.tgz) || echo "gpu_call: packing the results failed" | tee -a "$OUT/call.log"
fi
python3 benchmarks/jit_cache.py pack --out "$OUT"
exit "$rc"
