"""FlashInfer's SM90 GDN prefill kernel: the extend steps of GDN layers under chunk_impl="flashinfer".

FlashInfer 0.6 ships a Hopper kernel for the gated delta rule's prefill (CUTLASS, TMA, warp
specialised, one launch: `flashinfer.gdn_prefill`). Its own JIT module instantiates 32 variants in
one translation unit, which nvcc did not finish within a 480 s GPU call, and its launch function
allocates and frees the kernel's workspace in every call. csrc/gdn_prefill_sm90.cu instantiates the
one variant bf16 GDN layers with more value heads than key heads take (alpha and beta
given, an initial state per request) from FlashInfer's headers and launches it with a workspace kept
across calls and the values' row stride given, so they are read where the conv left them.

1. `jit_spec()`: the library as a FlashInfer JIT module, built by FlashInfer's own JIT (its flags for
   sm90a modules, its ninja build, its module cache). The module cache is one of the kernel caches a
   compiled bundle carries (compiler/splitops/bundle.py, CACHE_ENV "flashinfer"), so `hgc build`
   builds the library once (about 2 minutes of nvcc) where its start-up first runs a step past the
   bound, and a run loads it from the bundle's copy: nothing is built at start-up. The module's name
   carries a hash of the source, so an edited source is a new module, never a stale one.
2. `GdnPrefill(device)`: the library loaded with ctypes (plain C entry points: no binding layer), and
   the kernel's workspace (a TMA descriptor per SM) made once for the device.
3. `chunk_into_pool(...)`: one eager extend step over the slot-indexed state pool, what
   runtime/backends/triton_linear.py runs for a GDN layer's step past the bound: the requests'
   states gathered by slot into FlashInfer's layout ([Dv, Dk] per head, float32, whatever the pool
   keeps), the decays' exp and beta in float32 (its interface), the kernel, the final states put back.
   The gather, the gates and the put-back are one Triton launch each (`_states_in_kernel`,
   `_gates_kernel`, `_states_out_kernel`, through the Launcher) into workspaces kept per device:
   as torch ops they were six launches and about 150 us of host time in each layer's eager gap on
   an H100's host (index_select, the float copies, exp, index_copy_: the timeline of
   benchmarks/results/step_account_flashinfer_core_ab_h100_2026-12-06.md), which a gap spends
   while the device may be waiting for it.

Measured against our chunk kernels (benchmarks/probes/gdn_prefill_probe.py, H100, bench qwen3_next's
dims; the kernel and the copies around it, captured): 59.0 against 52.1 us at one request of 512
tokens, 128.9 against 170.0 at 2048, 219.2 against 315.6 at 4096, 120.4 against 292.8 at four of
1024 (its grid is a program per request and head; ours walks a request's state over the whole card).

In whole steps (benchmarks/results/step_account_flashinfer_ab_h100_2026-12-06.md) the kernel took
1770 against our 2829 us of a 4096-token step's 9 layers, the gathers, transposes and scatters here
about 200 us (before each way became one kernel), and the card's idle time in the piecewise steps
more than the difference (the gap-only plans run after a short first piece:
step_account_flashinfer_core_ab_h100_2026-12-06.md): the route is not the default.

Not done here: float16 or float32 activations, head dims other than 128, the in-step snapshots of the
prefix cache (the kernel returns a request's state after its last token only), capture: a bucket's
spare request rows are empty sequences, for which the kernel's loads and compute loop still take a
tail step (at block -1: flat_collective_tma_warpspecialized_delta_rule.hpp), and the route would
gather and scatter a state for each; the backend runs it in eager gaps.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2

__all__ = ["SOURCE", "HEAD_DIM", "GdnPrefill", "check_device", "check_layer", "chunk_into_pool", "jit_spec",
           "module_name", "prefill"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "gdn_prefill_sm90.cu"
HEAD_DIM = 128  # the variant's tile: Shape<_64, _64, _128> (csrc/gdn_prefill_sm90.cu)
_MAJOR = 9  # sm_90a code only


def module_name() -> str:
    """The JIT module's name: the source's hash in it (FlashInfer keys its cache by name alone)."""
    return "hgc_gdn_prefill_sm90_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def jit_spec():
    """The library as a FlashInfer JIT module, with the flags FlashInfer builds its own GDN prefill
    module with (flashinfer/jit/gdn.py)."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import gen_jit_spec, sm90a_nvcc_flags

    return gen_jit_spec(module_name(), [SOURCE], extra_cuda_cflags=sm90a_nvcc_flags + ["-DFLAT_SM90A_ENABLED",
                                                                                         "-std=c++20"],
                        extra_include_paths=[jit_env.FLASHINFER_CSRC_DIR])


def check_device(device: torch.device) -> None:
    """Refuse, in one line, a device or an installation the library cannot be built for or run on."""
    import importlib.util

    if torch.cuda.get_device_capability(device)[0] != _MAJOR:
        raise RuntimeError(f"chunk_impl=flashinfer: FlashInfer's GDN prefill kernel is built for sm_90a (Hopper); "
                           f"{torch.cuda.get_device_name(device)} is not one; route GDN with chunk_impl=triton")
    if importlib.util.find_spec("flashinfer") is None:
        raise RuntimeError("chunk_impl=flashinfer: FlashInfer is not installed here (pip install flashinfer-python); "
                           "its JIT builds the kernel's library")


def check_layer(dtype: "str | None", k_heads: int, v_heads: int, dk: int, dv: int, what: str) -> None:
    """Refuse, in one line naming the layer, a GDN layer the built variant cannot run (dtype: the
    activations', torch's name)."""
    why = []
    if dtype != "bfloat16":
        why.append(f"activations in {dtype or 'an unknown dtype'} (bfloat16 only)")
    if dk != HEAD_DIM or dv != HEAD_DIM:
        why.append(f"head dims {dk} / {dv} ({HEAD_DIM} only)")
    if v_heads <= k_heads or v_heads % k_heads:
        why.append(f"{v_heads} value heads over {k_heads} key heads (a larger multiple only: the GVA variant)")
    if why:
        raise ValueError(f"{what}: chunk_impl=flashinfer runs FlashInfer's SM90 GDN kernel in one variant, which "
                         f"cannot take {', '.join(why)}; route the layer with chunk_impl=triton")


class GdnPrefill:
    """The built library on one device: `launch` runs the kernel on the current stream."""

    def __init__(self, device: torch.device, path: Path | None = None):
        if device.type != "cuda":
            raise RuntimeError(f"chunk_impl=flashinfer: FlashInfer's GDN prefill kernel runs on CUDA, not {device}")
        check_device(device)
        if path is None:
            spec = jit_spec()
            if not spec.is_compiled:
                spec.build(verbose=False)  # where the kernel caches are watched, a build there is reported
            path = spec.get_library_path()
        lib = ctypes.CDLL(str(path))
        self.fn = lib.hgc_gdn_prefill_bf16_gva_into
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                            + [ctypes.c_int32] * 4 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int32,
                                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
        lib.hgc_gdn_prefill_workspace_bytes.restype = ctypes.c_size_t
        lib.hgc_gdn_prefill_workspace_bytes.argtypes = [ctypes.c_int32]
        self.device = device
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        # made once, outside any step: a launch allocates nothing
        self.workspace = torch.empty(lib.hgc_gdn_prefill_workspace_bytes(self.sms), dtype=torch.uint8, device=device)

    def launch(self, q, k, v, alpha, beta, scale: float, initial_state, cu_seqlens, output, output_state) -> None:
        """q, k [T, Hk, D] and output [T, Hv, D] contiguous bf16; v [T, Hv, D] bf16 with rows of any
        stride (heads of D); alpha, beta [T, Hv] float32; initial_state, output_state [R, Hv, D, D]
        float32 ([Dv, Dk] per head); cu_seqlens [R + 1] int64."""
        T, hk, d = q.shape
        hv = v.shape[1]
        if not (q.is_contiguous() and k.is_contiguous() and output.is_contiguous() and v.stride(2) == 1
                and v.stride(1) == d and initial_state.is_contiguous() and output_state.is_contiguous()):
            raise ValueError("flashinfer_gdn: q, k, output and the states must be contiguous, v's heads of D")
        rc = self.fn(output.data_ptr(), output_state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     v.stride(0), initial_state.data_ptr(), alpha.data_ptr(), beta.data_ptr(), cu_seqlens.data_ptr(),
                     cu_seqlens.numel() - 1, hk, hv, d, T, scale, self.sms, self.workspace.data_ptr(),
                     self.workspace.numel(), torch.cuda.current_stream(self.device).cuda_stream)
        if rc:  # the C side's codes: 3 workspace, 4 can_implement, 5 initialize, 6 run, 2 a CUDA error
            raise RuntimeError(f"flashinfer_gdn: FlashInfer's GDN prefill kernel failed to launch (code {rc}, "
                               f"csrc/gdn_prefill_sm90.cu) for {T} rows of {hk} / {hv} heads of {d}")


@functools.lru_cache(maxsize=None)
def prefill(device: torch.device) -> GdnPrefill:
    """The library on `device`, loaded (and where the module cache lacks it, built) on first use."""
    return GdnPrefill(device)


# Rows of Dk a program of the state copies moves: [STATE_BLOCK_K, Dv] tiles, 16 KiB of float32 at Dv 128.
STATE_BLOCK_K = 32
GATES_BLOCK = 1024


@triton.jit
def _state_tile(states_ptr, slots_ptr, flat_ptr, stride_slot, stride_head, HV, DK: tl.constexpr, DV: tl.constexpr,
                BK: tl.constexpr):
    """Program (r * HV + h, key block)'s tile of request r's head h: its [BK, DV] pointers into the
    pool (slot slots[r], [Dk, Dv] a head), its [DV, BK] pointers into the flat [R, HV, Dv, Dk] copy,
    and the key rows' mask [BK]."""
    rh = tl.program_id(0)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    offs_v = tl.arange(0, DV)
    slot = tl.load(slots_ptr + rh // HV).to(tl.int64)
    pool = states_ptr + slot * stride_slot + (rh % HV) * stride_head + offs_k[:, None] * DV + offs_v[None, :]
    flat = flat_ptr + rh.to(tl.int64) * DV * DK + offs_v[:, None] * DK + offs_k[None, :]
    return pool, flat, offs_k < DK


@triton.jit
def _states_in_kernel(states_ptr, slots_ptr, h0_ptr, stride_slot, stride_head, HV, DK: tl.constexpr,
                      DV: tl.constexpr, BK: tl.constexpr):
    """h0[r, h] = states[slots[r], h]^T in float32."""
    pool, flat, live = _state_tile(states_ptr, slots_ptr, h0_ptr, stride_slot, stride_head, HV, DK, DV, BK)
    tile = tl.load(pool, mask=live[:, None]).to(tl.float32)
    tl.store(flat, tl.trans(tile), mask=live[None, :])


@triton.jit
def _states_out_kernel(ht_ptr, slots_ptr, states_ptr, stride_slot, stride_head, HV, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr):
    """states[slots[r], h] = ht[r, h]^T in the pool's dtype."""
    pool, flat, live = _state_tile(states_ptr, slots_ptr, ht_ptr, stride_slot, stride_head, HV, DK, DV, BK)
    tile = tl.load(flat, mask=live[None, :])
    tl.store(pool, tl.trans(tile).to(states_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _gates_kernel(g_ptr, beta_ptr, alpha_ptr, beta32_ptr, n, stride_g, stride_b, HV, BLOCK: tl.constexpr):
    """alpha = exp(g) and beta32 = beta, float32 [rows, HV] contiguous, from g and beta [rows, HV]
    of any row stride."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    row, head = offs // HV, offs % HV
    g = tl.load(g_ptr + row * stride_g + head, mask=live, other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + row * stride_b + head, mask=live, other=0.0).to(tl.float32)
    tl.store(alpha_ptr + offs, tl.exp(g), mask=live)
    tl.store(beta32_ptr + offs, b, mask=live)


_STATES_IN = Launcher(_states_in_kernel)
_STATES_OUT = Launcher(_states_out_kernel)
_GATES = Launcher(_gates_kernel)


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(name: str, numel: int, device: torch.device) -> torch.Tensor:
    """`numel` float32 of the route's buffer `name` on `device` (the initial and final states
    [R, Hv, Dv, Dk], the gates [T, Hv] over the step's rows), grown to a power of two and never shrunk, as chunk.py's
    workspaces are, so an eager gap's launches find the same addresses step after step (the
    Launcher's hits). One layer's launches are done with them before the next layer's, in stream
    order."""
    held = _WORKSPACES.get((name, device))
    if held is None or held.numel() < numel:
        held = torch.empty(next_pow2(max(numel, 1)), dtype=torch.float32, device=device)
        _WORKSPACES[(name, device)] = held
    return held[:numel]


def chunk_into_pool(prefill_fn, q, k, v, g, beta, out, states, slots, cu_seqlens, rows: int, scale: float,
                    zero_padding: bool = True) -> None:
    """One eager extend step of a GDN layer's recurrent core over the pool, in place.

    q, k [T, Hk, D]; v [T, Hv, D] (a view of the conv's output); g [T, Hv] float32 log-decays; beta
    [T, Hv]; out [T, Hv, D]; states [num_slots + 1, Hv, Dk, Dv] float32 or bfloat16; slots [R] int64,
    the requests' slots (no padding slot); cu_seqlens [R + 1] int64 on the device; rows the real rows
    (cu_seqlens[R]). Rows from `rows` on come out zero, or are left as they are where `zero_padding`
    is False (a caller that never reads them). `prefill_fn`: a GdnPrefill's `launch` (tests stand in
    for it)."""
    if rows > 0:
        qr, kr = q[:rows].contiguous(), k[:rows].contiguous()  # views of the step's rows: no copy
        v_rows = v[:rows]
        if v_rows.stride(2) != 1 or v_rows.stride(1) != v.shape[2]:
            v_rows = v_rows.contiguous()
        R, hv, dk, dv = slots.shape[0], v.shape[1], q.shape[2], v.shape[2]
        if states.stride(3) != 1 or states.stride(2) != dv:
            raise ValueError("flashinfer_gdn: each head's [Dk, Dv] state in the pool must be contiguous")
        # [R, Hv, Dv, Dk] float32: FlashInfer's layout and state type, a copy the kernel may write
        h0 = _workspace("h0", R * hv * dv * dk, v.device).view(R, hv, dv, dk)
        ht = _workspace("ht", R * hv * dv * dk, v.device).view(R, hv, dv, dk)
        grid = (R * hv, cdiv(dk, STATE_BLOCK_K))
        _STATES_IN[grid](states, slots, h0, states.stride(0), states.stride(1), hv, DK=dk, DV=dv, BK=STATE_BLOCK_K)
        g, beta = (t if t.stride(1) == 1 else t.contiguous() for t in (g, beta))  # the gates kernel's heads
        # over every row of the step, padding too (never read): a bucket's steps then launch it with
        # one grid and the same arguments whatever their real rows, which the Launcher finds again
        T = out.shape[0]
        alpha = _workspace("alpha", T * hv, v.device).view(T, hv)
        beta32 = _workspace("beta", T * hv, v.device).view(T, hv)
        _GATES[(cdiv(T * hv, GATES_BLOCK),)](g, beta, alpha, beta32, T * hv, g.stride(0), beta.stride(0), hv,
                                            BLOCK=GATES_BLOCK)
        alpha, beta32 = alpha[:rows], beta32[:rows]
        o = out[:rows] if out.is_contiguous() else torch.empty_like(out[:rows], memory_format=torch.contiguous_format)
        prefill_fn(qr, kr, v_rows, alpha, beta32, scale, h0, cu_seqlens, o.view(rows, hv, dv), ht)
        if o.data_ptr() != out.data_ptr():
            out[:rows].copy_(o)
        _STATES_OUT[grid](ht, slots, states, states.stride(0), states.stride(1), hv, DK=dk, DV=dv, BK=STATE_BLOCK_K)
    if zero_padding and out.shape[0] > rows:
        out[rows:].zero_()
