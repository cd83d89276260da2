"""Host time of laying out one decode step: build_step, GraphRunner.build and the copy into the static buffers.

    python benchmarks/host/host_step_bench.py [--iters 50]

Every engine step pays this on the host before the GPU sees anything, so for small decode
steps it competes with the step itself (a batch-1 decode step of the bench checkpoint reads
about 0.56 ms of bytes on an H200). Runs on the CPU with a tiny compiled Qwen3-Next (the layout
does not depend on the model's size, only on requests, context length and page size).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hgc import main as hgc  # noqa: E402
from runtime.backends.cpu_reference import CPUReferenceBackend  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.step.bound_ops import BoundOps  # noqa: E402
from runtime.engine.generate import make_pools  # noqa: E402
from runtime.graphs.runner import GraphRunner  # noqa: E402
from runtime.artifact.loader import load_artifact  # noqa: E402

CASES = ((1, 2048), (8, 2048), (32, 2048), (128, 2048), (128, 8192))
PAGE = 16


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        assert hgc(["init-model", "--family", "qwen3_next", "--size", "tiny", "-o", f"{tmp}/c"]) == 0
        assert hgc(["compile", f"{tmp}/c", "-o", f"{tmp}/a", "--no-dumps"]) == 0
        art = load_artifact(f"{tmp}/a")
    print(f"{'requests':>8} {'context':>8} {'build_step ms':>14} {'runner.build ms':>16} {'fill ms':>8}")
    for batch, context in CASES:
        kv, st = make_pools(art.registry, context + PAGE, batch, page_size=PAGE)
        items = [(SeqState(st.alloc(), pages=kv.alloc(kv.pages_for(context)), num_cached=context - 1), [5])
                 for _ in range(batch)]
        ops = BoundOps(CPUReferenceBackend(kv, st))
        runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 8, 32, 128), extend_buckets=(),
                             max_pages_per_seq=kv.pages_for(context + PAGE))
        runner.sealed = True  # as after capture: build pads to the bucket; nothing is run here
        step, key = runner.build(items)
        build = median_ms(lambda: build_step(items, kv, "cpu", max_pages=runner.max_pages), args.iters)
        padded = median_ms(lambda: runner.build(items), args.iters)
        fill = median_ms(lambda: runner._fill(step, key), args.iters)
        print(f"{batch:>8} {context:>8} {build:>14.3f} {padded:>16.3f} {fill:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
