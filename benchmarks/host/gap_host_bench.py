"""Our Python in one fused GDN layer's eager gap: what triton_linear runs around its launches.

    python benchmarks/host/gap_host_bench.py --out /tmp/ghb                          # this checkout
    python benchmarks/host/gap_host_bench.py --out /tmp/ghb --baseline-ref 8e7f4a6   # and a commit's code

Under `chunk_impl=flashinfer` a GDN layer's whole fused mixer is an eager gap of a piecewise extend
step past `flashinfer_past` tokens, run on the static tables (plan_gap_step): the conv, the gates,
the state copies, FlashInfer's kernel and the gated norm, eight launches from Python. On an H100 the
host took about 0.55 ms a layer there, the card waiting on it up to 2048 tokens
(benchmarks/results/step_account_flashinfer_gap_tables_ab_h100_2026-12-06.md). This times the part
that is our code: `gdn_fused` on bench qwen3_next's dims (16 key / 32 value heads of 128, bf16) over
a 64-row bucket of one request with 40 real rows, on the CPU, with every Triton launch and
FlashInfer's launch replaced by a no-op (what remains is the backend's routing, plan lookups, shape
checks, the allocations and views, and the arguments each launch is handed). The Launcher's own hit path is
timed apart (`launcher_hit_us`: a 20-argument launch found again, its compiled kernel a no-op).
Neither includes the driver's launch or CUDA's allocator, so this is a share of the host time in
the trace, not all of it. --baseline-ref GITREF runs the same over GITREF's code, in a process of
its own (`git archive` into OUT/baseline-src). JSON to OUT/gap_host_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # code_root
from code_root import code_root, unpacked  # noqa: E402

CODE = code_root(sys.argv[1:])
sys.path.insert(0, str(CODE))
os.environ.setdefault("TRITON_INTERPRET", "1")  # no launch runs; triton must import without a GPU

import torch  # noqa: E402

NAME = "gap_host_bench"


def layer_call():
    """One fused GDN layer's gap call on the static tables, launches stubbed."""
    from compiler.splitops import Mode
    from runtime.backends.kernels.launch_cache import Launcher
    from runtime.backends.triton_linear import TritonLinearBackend
    from testkit.gdn_cases import BENCH_GDN, fused_gdn, gdn_inputs, gdn_params, gdn_pools
    from testkit.linear_cases import step_ctx

    Launcher.launch = lambda self, grid, args, kwargs: None  # for the rest of the process
    s = BENCH_GDN
    (pool,) = gdn_pools({0: s}, 8, "cpu", 0, copies=1)
    tri = TritonLinearBackend(pool, chunk_impl="flashinfer", flashinfer_past=8, flashinfer=lambda *a: None)
    tri.init_capture_state(max_tokens=64, max_seqs=1)
    ctx = step_ctx(Mode.EXTEND, [(3, 0, 40)], 24, 0, "cpu")
    tri.plan_gap_step(ctx, 1, 64)
    if tri._step.eager_extend is None or not tri._step.eager_extend.captured:
        raise SystemExit("gap_host_bench: plan_gap_step made no static-table plan for the step")
    x = gdn_inputs(s, 64, 40, torch.bfloat16, torch.Generator().manual_seed(0))
    p = gdn_params(s, torch.bfloat16, 1)
    out = torch.empty(64, s.hv, s.dv, dtype=torch.bfloat16)
    return lambda: fused_gdn(tri, ctx, x, p, out, 0, s, 1e-6)


def launcher_hit():
    """A Launcher's hit path: a 20-argument launch (9 tensors) with 8 keywords, found again."""
    from runtime.backends.kernels.launch_cache import Launcher

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            pass

    class Kernel:
        params = []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    class Hooks:
        launch_enter_hook = launch_exit_hook = None

    launcher = Launcher(Kernel())
    launcher._hooks = Hooks()
    launcher._device = lambda: 0
    launcher._stream = lambda device: 0
    args = tuple(torch.empty(16) for _ in range(9)) + (64, 8192, 32, 1, 32, 1, 2048, 2048, 32, 32, 1e-6)
    kwargs = dict(HK=16, GROUP=2, DK=128, BK=128, BG=2, BR=16, SOFTPLUS_MAX=20.0, num_warps=4)
    launcher[(4, 16)](*args, **kwargs)  # remembered
    return lambda: launcher[(4, 16)](*args, **kwargs)


def time_us(fn, iterations: int, reps: int) -> dict:
    for _ in range(max(10, iterations // 20)):
        fn()
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iterations):
            fn()
        runs.append((time.perf_counter() - t) / iterations * 1e6)
    return {"median_us": round(statistics.median(runs), 2), "min_us": round(min(runs), 2)}


def baseline(args, out: Path) -> dict:
    """This script over GITREF's code, in a process of its own; its JSON record."""
    src = unpacked(args.baseline_ref, out / "baseline-src")
    subprocess.run([sys.executable, __file__, "--out", str(out / "baseline"), "--code-root", str(src),
                    "--iterations", str(args.iterations), "--reps", str(args.reps)],
                   env=dict(os.environ, PYTHONPATH=str(src)), check=True)
    return json.loads((out / "baseline" / f"{NAME}.json").read_text())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Times on the CPU; the GPU host's launches and allocations come on top.")
    p.add_argument("--out", required=True, help="folder for gap_host_bench.json")
    p.add_argument("--iterations", type=int, default=2000, help="calls per repetition (default 2000)")
    p.add_argument("--reps", type=int, default=7, help="repetitions; the median is reported (default 7)")
    p.add_argument("--baseline-ref", default=None, help="also measure GITREF's code, in a process of its own")
    p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # read by code_root() above
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    # the Launcher first: layer_call() stubs every launch out
    hit = time_us(launcher_hit(), args.iterations * 5, args.reps)
    rec = {"code": str(CODE), "layer_gap_us": time_us(layer_call(), args.iterations, args.reps),
           "launcher_hit_us": hit}
    print(f"{CODE}: a fused GDN layer's gap, our Python: {rec['layer_gap_us']['median_us']:.1f} us; "
          f"a Launcher hit: {rec['launcher_hit_us']['median_us']:.2f} us", flush=True)
    if args.baseline_ref:
        rec["baseline_ref"] = args.baseline_ref
        rec["baseline"] = baseline(args, out)
        b, n = rec["baseline"]["layer_gap_us"]["median_us"], rec["layer_gap_us"]["median_us"]
        print(f"layer gap: {n:.1f} us against {b:.1f} at {args.baseline_ref} ({n / b:.2f}x)")
    (out / f"{NAME}.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
