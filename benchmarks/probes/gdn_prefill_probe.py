"""GDN's chunked extend: FlashInfer's SM90 prefill kernel against our chunk kernels (issue 51).

In a 4096-token step of bench qwen3_next the GDN layers' chunk kernels took 2.7 ms of 13.9 on an
H200 (`step_account_state_dtype_h200_2026-12-06.md`: solve, state walk and outputs at about 8% of
the matrix rate). FlashInfer 0.6 ships a Hopper kernel for the same recurrence
(`flashinfer.gdn_prefill.chunk_gated_delta_rule`: CUTLASS, TMA, warp-specialised, one launch).
This probe asks whether it is faster at bench qwen3_next's GDN dims (16 key heads, 32 value heads
of 128), and what a route onto it would cost around the kernel:

1. Check, before anything is timed: from a random non-zero state in every request, both kernels'
   outputs and final states against the CPU reference recurrence (cpu_reference.gated_recurrence,
   float32, on the CPU), relative error of the norm. FlashInfer documents its states as
   "k-major [N, H, K, V]"; its own tests transpose them before comparing with a [H, K, V]
   reference. Both readings are tried, for the initial state handed in and the final state read
   back, and the probe reports the one that matches.
2. Time what passed, each captured in a CUDA graph and replayed (a capture that fails is recorded,
   with its error, and that path is timed eagerly instead): ours (three launches over the slot
   pool, in place); FlashInfer's kernel alone on prepared inputs; and FlashInfer as a route would
   run it inside a step: the values made contiguous (the conv's output holds them as a strided
   view), the log-decays' exp and beta in float32 (its interface), the requests' states gathered
   from the pool in its layout, and its final states put back. FlashInfer's launch function
   allocates the kernel's workspace in every call, which no capture allows;
   runtime/backends/kernels/csrc/gdn_prefill_sm90.cu also launches the same kernel with a workspace kept across calls and the values' row stride given
   ("lean": no copy of the values, nothing allocated), checked first to give the plain launch's bits.

    $(python3 benchmarks/probes/gdn_prefill_probe.py --build-command)   # nvcc, once, any machine
    bash benchmarks/gpu_call.sh python3 benchmarks/probes/gdn_prefill_probe.py --out $OUT
    (carry benchmarks/probes/csrc/build; the runtime builds the same source through FlashInfer's JIT,
    runtime/backends/kernels/flashinfer_gdn.py, whose launch class the lean route here runs)
    python3 benchmarks/probes/gdn_prefill_probe.py --dry-run --out /tmp/gp   # CPU: plumbing only

The dry run runs our kernels in Triton's interpreter at tiny dims and stands in for FlashInfer with
the reference recurrence behind its interface (FlashInfer has no CPU kernel): it checks the probe's
plumbing, not FlashInfer. Writes OUT/gdn_prefill_probe.json.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, rel_err  # noqa: E402
from runtime.backends.cpu_reference import gated_recurrence  # noqa: E402
from runtime.backends.kernels.chunk import CHUNK_T, chunk_extend  # noqa: E402
from runtime.backends.kernels.flashinfer_gdn import SOURCE, GdnPrefill  # noqa: E402
from runtime.backends.kernels.launch_math import token_blocks  # noqa: E402
from runtime.backends.kernels.linear import GATE_PER_HEAD  # noqa: E402

GPU_DIMS = dict(hk=16, hv=32, d=128)  # bench qwen3_next's GDN layers (Qwen3-Next-80B-A3B's)
DRY_DIMS = dict(hk=2, hv=4, d=32)
GPU_CASES = ["1x512", "1x2048", "1x4096", "4x1024", "16x256"]  # requests x tokens each (issue 51's splits)
DRY_CASES = ["1x40", "2x24"]
TOL = 2e-2  # bf16 inputs, bf16 products in both kernels
LIBRARY = Path(__file__).resolve().parent / "csrc" / "build" / "libhgc_gdn_prefill_sm90.so"  # git-ignored; carried


def flashinfer_data() -> Path | None:
    """The `data` folder (csrc, cutlass headers) of the FlashInfer Python finds, or None."""
    import importlib.util

    spec = importlib.util.find_spec("flashinfer")
    return Path(spec.submodule_search_locations[0]) / "data" if spec else None


def build_command(library: Path, data: Path) -> list[str]:
    """nvcc over the runtime's csrc/gdn_prefill_sm90.cu with FlashInfer's flags for its sm90a modules
    (flashinfer/jit/core.py), against FlashInfer's headers under `data`. No GPU needed: built with
    nvcc 13.0 on the CPU machine in about 2 minutes."""
    return ["nvcc", "-std=c++20", "-O3", "-DNDEBUG", "-use_fast_math", "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
            "-DFLAT_SM90A_ENABLED", "-DFLASHINFER_ENABLE_BF16", "-Xcompiler", "-fPIC", "-shared",
            f"-I{data / 'csrc'}", f"-I{data / 'include'}", f"-I{data / 'cutlass' / 'include'}",
            f"-I{data / 'cutlass' / 'tools' / 'util' / 'include'}", "-o", str(library), str(SOURCE)]


def parse_case(case: str) -> tuple[int, int]:
    requests, tokens = case.split("x")
    return int(requests), int(tokens)


class StandInPrefill:
    """FlashInfer's `chunk_gated_delta_rule` interface over the reference recurrence, in FlashInfer's
    documented conventions (alpha the decay itself, beta float32, states [N, H, Dv, Dk]): the dry
    run's plumbing check. Never a claim about FlashInfer's kernel."""

    def __call__(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel=False, output=None, output_state=None):
        group = v.shape[1] // q.shape[1]
        bounds = cu_seqlens.tolist()
        for r in range(len(bounds) - 1):
            rows = slice(bounds[r], bounds[r + 1])
            state = initial_state[r].transpose(-1, -2).float().clone()
            o = gated_recurrence(q[rows].repeat_interleave(group, 1), k[rows].repeat_interleave(group, 1), v[rows],
                                 torch.log(g[rows])[..., None], beta[rows], state, scale)
            output[rows] = o.to(output.dtype)
            output_state[r] = state.transpose(-1, -2)
        return output, output_state

    def into(self, q, k, v, alpha, beta, scale, initial_state, cu_seqlens, output, output_state):
        """The launch with the caller's workspace (PrefillLibrary.into): the same computation."""
        self(q, k, v, alpha, beta, scale, initial_state, True, cu_seqlens, output=output, output_state=output_state)


class PrefillLibrary:
    """FlashInfer's kernel in the one variant csrc/gdn_prefill_sm90.cu builds (bf16, GVA, alpha, beta,
    initial states), called through ctypes behind FlashInfer's Python interface. FlashInfer's own JIT
    module instantiates its 32 variants in one translation unit, which nvcc did not finish within a
    GPU call (480 s); the kernel and its launch are FlashInfer's either way."""

    def __init__(self, path: Path):
        import ctypes

        lib = ctypes.CDLL(str(path))
        self.fn = lib.hgc_gdn_prefill_bf16_gva
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int32] * 5
                            + [ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p])
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        # the kept-workspace launch, as the runtime's route runs it (chunk_impl=flashinfer)
        self.into = GdnPrefill(torch.device("cuda"), path).launch

    def __call__(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel=False, output=None, output_state=None):
        T, hq, d = q.shape
        hv = v.shape[1]
        assert k.shape == q.shape and v.shape == (T, hv, d) and hv > hq and hv % hq == 0, "GVA shapes only"
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, initial_state, output, output_state, cu_seqlens))
        assert q.dtype == k.dtype == v.dtype == output.dtype == torch.bfloat16 and cu_seqlens.dtype == torch.int64
        assert g.dtype == beta.dtype == initial_state.dtype == output_state.dtype == torch.float32
        assert g.shape == beta.shape == (T, hv) and initial_state.shape == output_state.shape
        rc = self.fn(output.data_ptr(), output_state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     initial_state.data_ptr(), g.data_ptr(), beta.data_ptr(), cu_seqlens.data_ptr(),
                     cu_seqlens.numel() - 1, hq, hq, hv, d, T, scale, self.sms,
                     torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"FlashInfer's GDN prefill failed (code {rc}; its message above)")
        return output, output_state


def flashinfer_prefill(dry: bool, library: Path):
    if dry:
        return StandInPrefill()
    return PrefillLibrary(library)


def make_case(R: int, L: int, dims: dict, device, gen: torch.Generator, dt: torch.dtype) -> dict:
    """One step's GDN inputs as the fused mixer hands them on: q, k l2-normalised [T, Hk, D], v a
    strided view of the conv's output [T, C], log-decays float32 [T, Hv] (negative), beta [T, Hv] in
    the activation dtype `dt`, and a non-zero float32 state for every request."""
    hk, hv, d = dims["hk"], dims["hv"], dims["d"]
    T = R * L

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(randn(T, hk, d), dim=-1).to(dt)
    k = F.normalize(randn(T, hk, d), dim=-1).to(dt)
    mixed = randn(T, 2 * hk * d + hv * d).to(dt)
    mixed[:, 2 * hk * d:] = randn(T, hv * d).to(dt)
    g = -F.softplus(randn(T, hv)) * 0.5  # GDN's -exp(A_log) * softplus(a + dt_bias): decays in (0, 1)
    beta = torch.sigmoid(randn(T, hv)).to(dt)
    h0 = randn(R, hv, d, d) * 0.05
    case = dict(q=q, k=k, mixed=mixed, g=g, beta=beta, h0=h0)
    case = {name: t.to(device) for name, t in case.items()}
    case["v"] = case["mixed"][:, 2 * hk * d:].view(T, hv, d)
    case.update(R=R, L=L, T=T, scale=d ** -0.5,
                cu=torch.arange(0, T + 1, L, dtype=torch.int64, device=device))
    return case


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [T, Hv, D] and final states [R, Hv, Dk, Dv], float32 on the CPU, request by request."""
    q, k, v, g, beta = (case[n].cpu() for n in ("q", "k", "v", "g", "beta"))
    group = v.shape[1] // q.shape[1]
    outs, states = [], []
    for r in range(case["R"]):
        rows = slice(r * case["L"], (r + 1) * case["L"])
        state = case["h0"][r].cpu().clone()
        outs.append(gated_recurrence(q[rows].repeat_interleave(group, 1), k[rows].repeat_interleave(group, 1),
                                     v[rows], g[rows][..., None], beta[rows], state, case["scale"]))
        states.append(state)
    return torch.cat(outs), torch.stack(states)


class Ours:
    """Our chunk kernels over a slot pool holding the requests' states in slots 1..R (slot 0 is the
    padding slot, which the kernels neither read nor write)."""

    def __init__(self, case: dict):
        dev = case["q"].device
        R = case["R"]
        self.case = case
        self.pool = torch.zeros(R + 1, *case["h0"].shape[1:], dtype=torch.float32, device=dev)
        self.slots = torch.arange(1, R + 1, dtype=torch.int64, device=dev)
        lens = [case["L"]] * R
        self.chunks = torch.from_numpy(token_blocks(lens, CHUNK_T)).to(dev)
        self.out = torch.empty_like(case["v"], memory_format=torch.contiguous_format)

    def reset(self) -> None:
        self.pool[1:].copy_(self.case["h0"])

    def __call__(self) -> None:
        c = self.case
        chunk_extend(c["q"], c["k"], c["v"], c["g"], c["beta"], self.out, self.pool, self.slots, c["cu"],
                     self.chunks, c["scale"], GATE_PER_HEAD)


class Theirs:
    """FlashInfer's kernel: `kernel()` on inputs prepared once, `route()` with the preparation a
    step would run (the states in the pool's [Dk, Dv] layout; `transposed`: FlashInfer's [Dv, Dk])."""

    def __init__(self, case: dict, prefill, transposed: bool):
        self.case, self.prefill, self.transposed = case, prefill, transposed
        R = case["R"]
        self.v = case["v"].contiguous()
        self.alpha = torch.exp(case["g"])
        self.beta = case["beta"].float()
        self.pool = torch.zeros(R + 1, *case["h0"].shape[1:], dtype=torch.float32, device=case["q"].device)
        self.slots = torch.arange(1, R + 1, dtype=torch.int64, device=self.pool.device)  # as Ours
        self.h0 = torch.empty_like(case["h0"])
        self.out = torch.empty_like(self.v)
        self.state = torch.empty_like(case["h0"])

    def _layout(self, states: torch.Tensor) -> torch.Tensor:
        return states.transpose(-1, -2) if self.transposed else states

    def reset(self) -> None:
        self.pool[1:].copy_(self.case["h0"])
        self.h0.copy_(self._layout(self.case["h0"]))

    def kernel(self) -> None:
        c = self.case
        self.prefill(c["q"], c["k"], self.v, self.alpha, self.beta, c["scale"], self.h0, True, c["cu"], False,
                     output=self.out, output_state=self.state)

    def route(self) -> None:
        c = self.case
        self.v.copy_(c["v"])
        torch.exp(c["g"], out=self.alpha)
        self.beta.copy_(c["beta"])
        self.h0.copy_(self._layout(self.pool.index_select(0, self.slots)))
        self.kernel()
        self.pool.index_copy_(0, self.slots, self._layout(self.state))

    def lean(self) -> None:
        """What a route with the kept-workspace launch needs around the kernel: the values read where
        the conv left them (no copy), exp of the decays, beta in float32, the states gathered and
        put back in FlashInfer's layout."""
        c = self.case
        torch.exp(c["g"], out=self.alpha)
        self.beta.copy_(c["beta"])
        self.h0.copy_(self._layout(self.pool.index_select(0, self.slots)))
        self.prefill.into(c["q"], c["k"], c["v"], self.alpha, self.beta, c["scale"], self.h0, c["cu"], self.out,
                          self.state)
        self.pool.index_copy_(0, self.slots, self._layout(self.state))

    def final_states(self) -> torch.Tensor:
        return self._layout(self.state)


def check(case: dict, ref_out, ref_state, prefill) -> dict:
    ours = Ours(case)
    ours.reset()
    ours()
    result = {"ours_out": rel_err(ours.out, ref_out), "ours_state": rel_err(ours.pool[1:], ref_state)}
    layouts = {}
    for transposed in (True, False):
        theirs = Theirs(case, prefill, transposed)
        theirs.reset()
        theirs.kernel()
        layouts["dv_dk" if transposed else "dk_dv"] = {"out": rel_err(theirs.out, ref_out),
                                                        "state": rel_err(theirs.final_states(), ref_state)}
    result["flashinfer"] = layouts
    matching = [name for name, errs in layouts.items() if max(errs.values()) < TOL]
    result["flashinfer_layout"] = matching[0] if matching else None
    if matching:  # the kept-workspace launch on the strided values: the kernel's bits
        theirs = Theirs(case, prefill, transposed=matching[0] == "dv_dk")
        theirs.reset()
        theirs.kernel()
        want_out, want_state = theirs.out.clone(), theirs.final_states().clone()
        theirs.reset()
        theirs.lean()
        result["lean_same_bits"] = bool(torch.equal(theirs.out, want_out)
                                        and torch.equal(theirs.pool[1:], want_state.to(theirs.pool.dtype)))
    result["ours_ok"] = max(result["ours_out"], result["ours_state"]) < TOL
    return result


def timed_ms(fn, dry: bool, reps: int = 50) -> tuple[float, str | None]:
    """(ms a call, why a capture failed or None): replays of fn captured in a CUDA graph, else eager
    calls (the dry run: a few eager calls on the CPU)."""
    fn()
    if dry:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, None
    import triton

    torch.cuda.synchronize()
    failure = None
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()  # the capture's warm-up on its own stream, as torch's graph tutorial does
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        torch.cuda.synchronize()
        run = fn
    return float(triton.testing.do_bench(run, warmup=10, rep=200, return_mode="median")), failure


def probe_case(name: str, dims: dict, device, prefill, dry: bool, gen) -> dict:
    R, L = parse_case(name)
    # bf16 on the card; float32 in the interpreter, whose bf16 tl.dot is not the card's
    case = make_case(R, L, dims, device, gen, torch.float32 if dry else torch.bfloat16)
    ref_out, ref_state = reference(case)
    row = {"case": name, "requests": R, "tokens": case["T"], "checks": check(case, ref_out, ref_state, prefill)}
    layout = row["checks"]["flashinfer_layout"]
    timings, failures = {}, {}
    if row["checks"]["ours_ok"]:
        ours = Ours(case)
        ours.reset()
        timings["ours"], failures["ours"] = timed_ms(ours, dry)
    if layout is not None:
        theirs = Theirs(case, prefill, transposed=layout == "dv_dk")
        theirs.reset()
        timings["flashinfer_kernel"], failures["flashinfer_kernel"] = timed_ms(theirs.kernel, dry)
        theirs.reset()
        timings["flashinfer_route"], failures["flashinfer_route"] = timed_ms(theirs.route, dry)
        if row["checks"].get("lean_same_bits"):
            theirs.reset()
            timings["flashinfer_lean"], failures["flashinfer_lean"] = timed_ms(theirs.lean, dry)
    row["us"] = {k: v * 1e3 for k, v in timings.items()}
    row["capture_failed"] = {k: v for k, v in failures.items() if v}
    if "ours" in timings and "flashinfer_route" in timings:
        row["route_over_ours"] = timings["flashinfer_route"] / timings["ours"]
    if "ours" in timings and "flashinfer_lean" in timings:
        row["lean_over_ours"] = timings["flashinfer_lean"] / timings["ours"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| case | ours out / state | FlashInfer out / state (layout) | ours us | FlashInfer kernel us | "
             "FlashInfer route us | route / ours | lean route us | lean / ours |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        c = row["checks"]
        layout = c["flashinfer_layout"]
        fi = c["flashinfer"].get(layout or "dv_dk")
        us = row["us"]
        lines.append(f"| {row['case']} | {c['ours_out']:.1e} / {c['ours_state']:.1e} | {fi['out']:.1e} / "
                     f"{fi['state']:.1e} ({layout or 'no layout matched'}) | {us.get('ours', float('nan')):.1f} | "
                     f"{us.get('flashinfer_kernel', float('nan')):.1f} | {us.get('flashinfer_route', float('nan')):.1f} "
                     f"| {row.get('route_over_ours', float('nan')):.2f} | {us.get('flashinfer_lean', float('nan')):.1f} "
                     f"| {row.get('lean_over_ours', float('nan')):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="folder for gdn_prefill_probe.json (required but with --build-command)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: our kernels interpreted at tiny dims, FlashInfer "
                                                           "stood in for by the reference (plumbing only)")
    ap.add_argument("--library", type=Path, default=LIBRARY,
                    help="the build of csrc/gdn_prefill_sm90.cu (default: %(default)s; see --build-command)")
    ap.add_argument("--build-command", action="store_true",
                    help="print the nvcc command that builds --library from FlashInfer's headers, and exit")
    ap.add_argument("--cases", default=None, help="comma list of REQUESTSxTOKENS (default: "
                                                  f"{','.join(GPU_CASES)}; dry run {','.join(DRY_CASES)})")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.build_command:
        data = flashinfer_data()
        if data is None:
            ap.error("--build-command: no FlashInfer importable here to take its headers from (unpack its wheel "
                     "and put the folder on PYTHONPATH)")
        print(" ".join(build_command(args.library, data)))
        return 0
    if not args.out:
        ap.error("--out is required")
    if not dry and not args.library.is_file():
        ap.error(f"--library: {args.library} is not built (python3 {Path(__file__).name} --build-command)")
    if not dry and not torch.cuda.is_available():
        ap.error("no CUDA device: use --dry-run on a CPU")
    device = torch.device("cpu" if dry else "cuda")
    dims = DRY_DIMS if dry else GPU_DIMS
    cases = args.cases.split(",") if args.cases else (DRY_CASES if dry else GPU_CASES)
    for case in cases:
        try:
            parse_case(case)
        except ValueError:
            ap.error(f"--cases: {case!r} is not REQUESTSxTOKENS (e.g. 1x4096)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefill = flashinfer_prefill(dry, args.library)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in cases:
        try:
            rows.append(probe_case(case, dims, device, prefill, dry, gen))
        except Exception:  # noqa: BLE001 - one case's failure is reported, the others still run
            rows.append({"case": case, "error": traceback.format_exc()})
            print(f"[{case}] failed:\n{rows[-1]['error']}", flush=True)
            continue
        print(f"[{case}] {json.dumps(rows[-1]['checks'])} us {rows[-1]['us']} "
              f"capture failed: {rows[-1]['capture_failed']}", flush=True)
    result = {"env": device_facts(dry), "dims": dims, "dry_run": dry, "rows": rows}
    (out / "gdn_prefill_probe.json").write_text(json.dumps(result, indent=1))
    print(table([r for r in rows if "error" not in r]))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
