"""The bench MoE layers that gpu_moe.py times and tune_moe.py tunes: their shapes, the routing,
the run's device, dims and timers (`Bench`), and random weights in the moe op's schema order
(`make_layer`). Both scripts set TRITON_INTERPRET for a dry run before they import this module."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import triton
import triton.testing

# Bench layers: Qwen3-Next-like (hidden 2048, expert width 512, softmax, norm_topk_prob, one shared
# expert of width 512 behind a sigmoid gate). A layer may name its own D, I and S: the `_tp2` ones
# are what one rank of tensor parallel 2 holds of a full-size release (every expert, half of its
# intermediate channels, and half of the shared expert's), so their configs are tuned for the
# shapes those ranks run. They keep this file's softmax routing: routing does not change the
# expert GEMMs being tuned.
SHAPES = {"e16": dict(E=16, top_k=4), "e512": dict(E=512, top_k=10),
          "e512_tp2": dict(E=512, top_k=10, I=256, S=256),           # Qwen3-Next-80B-A3B, TP 2
          "e256_tp2": dict(E=256, top_k=8, D=2304, I=512, S=512)}    # Kimi-Linear-48B-A3B, TP 2
D_GPU, I_GPU, S_GPU = 2048, 512, 512
# Dry run: tiny dims on the interpreter.
DRY_SHAPES = {"e8": dict(E=8, top_k=2), "e16": dict(E=16, top_k=4)}
D_DRY, I_DRY, S_DRY = 128, 64, 64
ROUTING = dict(scoring="softmax", renormalize=True, routed_scale=1.0, num_groups=1, topk_groups=1)

TOL_GPU = 1e-2
# Triton's interpreter rounds float32 -> bf16 by truncation (twice the error of the GPU's rounding).
TOL_INTERPRETER = 3e-2


class Bench:
    """Device, dtype, dims and a median timer (milliseconds) for one run."""

    def __init__(self, dry_run: bool, shared: bool = True):
        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        if not dry_run and not torch.cuda.is_available():
            raise SystemExit("gpu_moe: no CUDA device (use --dry-run on the CPU)")
        self.dtype = torch.bfloat16
        self.D, self.I = (D_DRY, I_DRY) if dry_run else (D_GPU, I_GPU)
        self.S = 0 if not shared else (S_DRY if dry_run else S_GPU)  # shared expert width (gated), 0: none
        self.tol = TOL_INTERPRETER if dry_run else TOL_GPU

    def for_shape(self, shape: dict) -> "Bench":
        """This bench with the layer's own D, I and S where the shape names them."""
        bench = copy.copy(self)
        bench.D, bench.I = shape.get("D", self.D), shape.get("I", self.I)
        bench.S = shape.get("S", self.S) if self.S else 0
        return bench

    def time_ms(self, fn, rep_ms: int = 100) -> float:
        if self.dry:
            fn()
            runs = []
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(runs)
        return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))

    def graph_ms(self, fn, rep_ms: int = 100):
        """Capture fn in a CUDA graph (after an eager warm-up that compiles) and time replays.

        Returns (ms, graph). On the CPU there is no graph: fn is timed directly.
        """
        fn()
        if self.dry:
            return self.time_ms(fn, rep_ms), None
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return self.time_ms(graph.replay, rep_ms), graph

    def sync(self):
        if not self.dry:
            torch.cuda.synchronize()


def runtime_config(bench: Bench, T: int, E: int, top_k: int):
    """(the tiles the runtime's fused MoE takes for a step of T tokens on this card: the backend's
    tuned table for (E, I, card) where it has one, else default_config, fitted to shared memory as
    the backend fits them; "tuned" or "default"). A probe timed against other tiles compares with
    what never runs: on an H200 the tuned down took 88 us at 4096 tokens, default_config's 125.7."""
    from runtime.backends.kernels.moe_config import device_name_of, fit_shared_memory
    from runtime.backends.triton_moe import TritonMoEBackend

    backend = TritonMoEBackend(device=bench.device)
    tuned = backend.config_path(E, bench.I, device_name_of(bench.device)).is_file()
    config = backend.config_for(T, E, bench.I, bench.D, top_k, bench.device)
    return fit_shared_memory(config, bench.dtype.itemsize), "tuned" if tuned else "default"


def make_layer(bench: Bench, E: int, seed: int) -> tuple:
    """Random bf16 weights scaled so activations stay O(1), in the moe op's schema order:
    (router, router_bias None, w13, w2, shared_w13, shared_w2, shared_gate); the shared three are
    None when the bench has no shared expert."""
    g = torch.Generator(device=bench.device).manual_seed(seed)
    D, I, S, dev, dt = bench.D, bench.I, bench.S, bench.device, bench.dtype
    router = (torch.randn(E, D, device=dev, generator=g) * D ** -0.5).to(dt)
    w13 = torch.randn(E, 2 * I, D, device=dev, dtype=dt, generator=g).mul_(D ** -0.5)
    w2 = torch.randn(E, D, I, device=dev, dtype=dt, generator=g).mul_(I ** -0.5)
    if not S:
        return router, None, w13, w2, None, None, None
    sw13 = torch.randn(2 * S, D, device=dev, dtype=dt, generator=g).mul_(D ** -0.5)
    sw2 = torch.randn(D, S, device=dev, dtype=dt, generator=g).mul_(S ** -0.5)
    gate = (torch.randn(1, D, device=dev, generator=g) * D ** -0.5).to(dt)
    return router, None, w13, w2, sw13, sw2, gate
