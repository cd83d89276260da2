"""The decode conv (runtime/backends/kernels/linear.py `_short_conv_decode_kernel`) against two ways
of moving its history in wider loads.

At 128 requests the decode conv of bench qwen3_next (8192 channels, width 4, bfloat16) took 10.9 us
a GDN layer on an H200 (step_account_state_dtype_h200_2026-12-06.md) for about 16.8 MB of history
read and written, inputs and outputs: 36% of the card's copy rate. The history is [slots, C, K-1]:
a channel's three inputs sit 6 bytes apart, so each thread reads and writes them as 2-byte scalars,
and reads them twice (the window, then the shifted window it stores). Variants, each a probe kernel:

- `rows`: the runtime's kernel on [slots, C, K-1] histories, at `conv_config`'s tile and another;
- `rows_last`: the runtime's kernel on histories stored [slots, K-1, C] (the state pool's layout,
  CONV_HISTORY_CHANNELS_LAST), which it addresses through their strides, at tiles up to 1024;
- `flat`: the same layout, the tile's K-1 history columns of BC channels read as one contiguous
  run of (K-1) BC elements (vector loads), each column gathered from it in registers (tl.gather),
  the rolled history stored back as one contiguous run;
- `channels_last`: a kernel of its own on the [slots, K-1, C] storage, its tile [K, BC] (columns
  by channels). It was 1.2x faster than the runtime's kernel of a [BC, K] tile over that storage
  (conv_decode_probe_h100_2026-12-06.json), which then took its tile's orientation.

Each variant is checked against a float64 reference on fresh random inputs (outputs and the rolled
history, padding rows zero and their slot untouched, relative error of the norm) before it is
timed in a CUDA graph over enough pools that the L2 holds none of them.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/conv_decode_probe.py --out $OUT
    python3 benchmarks/probes/conv_decode_probe.py --dry-run --out /tmp/conv   # CPU: interpreted, small

Writes OUT/conv_decode_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the kernel in Triton's interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_common import device_facts, device_rates, graph_call_us, rel_err  # noqa: E402
from runtime.backends.kernels import linear  # noqa: E402
from runtime.backends.kernels.launch_math import cdiv, next_pow2  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT  # noqa: E402

CHECK_TOL = 1e-2  # bfloat16 outputs and histories against the float64 step
C, K = 8192, 4
DRY_C = 96  # not a multiple of the dry tiles: the last tile's masks are exercised
BATCHES, DRY_BATCHES = (1, 32, 128, 256), (3,)
# (channels a program, warps) of each variant
ROWS_TILES = [(128, 2), (256, 4)]
ROWS_LAST_TILES = [(128, 1), (256, 1), (256, 2), (512, 2), (1024, 4)]
FLAT_TILES = [(128, 2), (256, 2), (256, 4), (512, 4)]
LAST_TILES = [(256, 1), (512, 2), (1024, 4), (2048, 8)]
DRY_TILES = [(32, 1), (64, 2)]


@triton.jit
def _flat_kernel(x_ptr, w_ptr, out_ptr, state_ptr, slots_ptr, stride_x_row, stride_o_row, stride_s_slot, C,
                 KW: tl.constexpr, BC: tl.constexpr, BF: tl.constexpr, PAD_SLOT: tl.constexpr):
    """[slots, C, K-1] history; a tile's (K-1) BC history elements are one contiguous run (BF, the
    next power of two, covers it)."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BC
    offs_c = c0 + tl.arange(0, BC)
    m_c = offs_c < C
    offs_f = tl.arange(0, BF)  # flat positions: channel f // (K-1), column f % (K-1)
    m_f = (offs_f < (KW - 1) * BC) & (c0 * (KW - 1) + offs_f < C * (KW - 1))
    o_ptrs = out_ptr + row * stride_o_row + offs_c
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        f_ptrs = state_ptr + slot * stride_s_slot + c0 * (KW - 1) + offs_f
        flat = tl.load(f_ptrs, mask=m_f, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x_row + offs_c, mask=m_c, other=0.0).to(tl.float32)
        ch = tl.arange(0, BC)
        y = x * tl.load(w_ptr + offs_c * KW + KW - 1, mask=m_c, other=0.0).to(tl.float32)
        for j in tl.static_range(KW - 1):
            h = tl.gather(flat, ch * (KW - 1) + j, 0)
            y += h * tl.load(w_ptr + offs_c * KW + j, mask=m_c, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(y)
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_c)
        # rolled: position f takes f + 1, a channel's last column the new input
        nxt = tl.gather(flat, tl.minimum(offs_f + 1, BF - 1), 0)
        new_x = tl.gather(x, tl.minimum(offs_f // (KW - 1), BC - 1), 0)
        rolled = tl.where(offs_f % (KW - 1) == KW - 2, new_x, nxt)
        tl.debug_barrier()
        tl.store(f_ptrs, rolled.to(state_ptr.dtype.element_ty), mask=m_f)
    else:
        tl.store(o_ptrs, tl.zeros([BC], dtype=out_ptr.dtype.element_ty), mask=m_c)


@triton.jit
def _channels_last_kernel(x_ptr, w_ptr, out_ptr, state_ptr, slots_ptr, stride_x_row, stride_o_row, stride_s_slot, C,
                          KW: tl.constexpr, KWP: tl.constexpr, BC: tl.constexpr, PAD_SLOT: tl.constexpr):
    """[slots, K-1, C] history: column j of the tile is BC contiguous elements at j C."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = offs_c < C
    cols = tl.arange(0, KWP)
    o_ptrs = out_ptr + row * stride_o_row + offs_c
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        h_ptrs = state_ptr + slot * stride_s_slot + cols[:, None] * C + offs_c[None, :]
        m_h = (cols[:, None] < KW - 1) & m_c[None, :]
        hist = tl.load(h_ptrs, mask=m_h, other=0.0).to(tl.float32)  # [KWP, BC]
        x = tl.load(x_ptr + row * stride_x_row + offs_c, mask=m_c, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_c[None, :] * KW + cols[:, None], mask=(cols[:, None] < KW) & m_c[None, :],
                    other=0.0).to(tl.float32)  # [KWP, BC]
        window = tl.where(cols[:, None] == KW - 1, x[None, :], hist)
        y = tl.sum(window * w, axis=0)
        y = y * tl.sigmoid(y)
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_c)
        shifted = tl.load(h_ptrs + C, mask=(cols[:, None] < KW - 2) & m_c[None, :], other=0.0).to(tl.float32)
        rolled = tl.where(cols[:, None] == KW - 2, x[None, :], shifted)
        tl.debug_barrier()
        tl.store(h_ptrs, rolled.to(state_ptr.dtype.element_ty), mask=m_h)
    else:
        tl.store(o_ptrs, tl.zeros([BC], dtype=out_ptr.dtype.element_ty), mask=m_c)


def run_rows(x, w, out, hist, slots, bc, warps):
    """The runtime's kernel on [slots, C, K-1] histories at a tile of bc channels on `warps` warps."""
    linear.short_conv_decode(x, w, None, out, hist, slots, True, config=linear.ConvConfig(bc, warps))


def run_rows_last(x, w, out, hist, slots, bc, warps):
    """The runtime's kernel on histories stored [slots, K-1, C], given their [slots, C, K-1] view."""
    run_rows(x, w, out, hist.transpose(1, 2), slots, bc, warps)


def run_flat(x, w, out, hist, slots, bc, warps):
    Cx = x.shape[1]
    _flat_kernel[(x.shape[0], cdiv(Cx, bc))](x, w, out, hist, slots, x.stride(0), out.stride(0), hist.stride(0), Cx,
                                              KW=K, BC=bc, BF=next_pow2((K - 1) * bc), PAD_SLOT=PADDING_SLOT,
                                              num_warps=warps)


def run_last(x, w, out, hist, slots, bc, warps):
    Cx = x.shape[1]
    _channels_last_kernel[(x.shape[0], cdiv(Cx, bc))](x, w, out, hist, slots, x.stride(0), out.stride(0),
                                                       hist.stride(0), Cx, KW=K, KWP=next_pow2(K), BC=bc,
                                                       PAD_SLOT=PADDING_SLOT, num_warps=warps)


VARIANTS = {"rows": (run_rows, False), "rows_last": (run_rows_last, True), "flat": (run_flat, False),
            "channels_last": (run_last, True)}


def reference(x, w, hist, slots):
    """(out, the rolled histories) in float64 of [slots, C, K-1] histories."""
    x, w, hist = x.double().cpu(), w.double().cpu(), hist.double().cpu().clone()
    out = torch.zeros_like(x)
    for b, slot in enumerate(slots.tolist()):
        if slot == PADDING_SLOT:
            continue
        window = torch.cat([hist[slot], x[b][:, None]], 1)  # [C, K]
        y = (window * w).sum(1)
        out[b] = y * torch.sigmoid(y)
        hist[slot] = window[:, 1:]
    return out, hist


def problem(B: int, channels: int, device, g: torch.Generator):
    """x [B, C] (a view of a wider projection output, as the runtime's conv input is), w [C, K], the
    [slots, C, K-1] histories and slots: B requests on slots 1..B, the last one padding past one."""
    proj = torch.randn(B, channels + 64, generator=g).to(torch.bfloat16)
    x = proj[:, :channels]
    w = (torch.randn(channels, K, generator=g) * 0.5).to(torch.bfloat16)
    hist = torch.randn(B + 2, channels, K - 1, generator=g).to(torch.bfloat16)
    slots = torch.arange(1, B + 1)
    if B > 1:
        slots[-1] = PADDING_SLOT
    return x.to(device), w.to(device), hist.to(device), slots.to(device)


def laid_out(hist: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """[slots, C, K-1] histories as they are, or (channels_last) stored [slots, K-1, C]."""
    return hist.transpose(1, 2).contiguous() if channels_last else hist.clone()


def as_rows(hist: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return hist.transpose(1, 2) if channels_last else hist


def check(name, run, channels_last, tile, B, channels, device, g) -> float:
    x, w, hist, slots = problem(B, channels, device, g)
    want_out, want_hist = reference(x, w, hist, slots)
    mine = laid_out(hist, channels_last)
    out = torch.full_like(x, float("nan"))
    run(x, w, out, mine, slots, *tile)
    got = as_rows(mine, channels_last)
    if not torch.equal(got[0].cpu(), hist[0].cpu()) or not torch.equal(got[B + 1:].cpu(), hist[B + 1:].cpu()):
        raise SystemExit(f"{name} {tile} at {B}: a slot no request holds was written")
    err = max(rel_err(out, want_out), rel_err(got, want_hist))
    if err > CHECK_TOL or (B > 1 and out[-1].abs().max().item() != 0):
        raise SystemExit(f"{name} {tile} at {B}: rel err {err:.2e} (or a padding row not zero)")
    return err


def _in_use(B: int, channels: int, device) -> list[int]:
    cfg = linear.conv_config(channels)
    return [cfg.block_c, cfg.num_warps]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, small shapes")
    args = p.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    channels = DRY_C if dry else C
    doc = {"env": device_facts(dry), "channels": channels, "width": K, "batches": {}}
    if not dry:
        doc["rates"] = device_rates()
    rate = doc.get("rates", {}).get("copy_bytes_per_s")
    g = torch.Generator().manual_seed(0)
    tiles = {"rows": ROWS_TILES, "rows_last": ROWS_LAST_TILES, "flat": FLAT_TILES, "channels_last": LAST_TILES}
    for B in (DRY_BATCHES if dry else BATCHES):
        real = B - 1 if B > 1 else 1
        moved = real * channels * (2 * 2 * (K - 1) + 2 + 2)  # history read + written, x, out (bf16)
        row = doc["batches"][str(B)] = {"bytes": moved, "floor_us": moved / rate * 1e6 if rate else None,
                                        "in_use": _in_use(B, channels, device)}
        # pools enough that the L2 (about 50 MB) holds none of the histories a graph walks
        rotate = 1 if dry else max(1, min(16, (120 << 20) // (moved + 1)))
        for name, (run, last) in VARIANTS.items():
            for tile in (DRY_TILES if dry else tiles[name]):
                err = check(name, run, last, tile, B, channels, device, g)
                sets = [problem(B, channels, device, g) for _ in range(rotate)]
                sets = [(x, w, laid_out(h, last), s, torch.empty_like(x)) for x, w, h, s in sets]
                us = graph_call_us(lambda i: run(sets[i][0], sets[i][1], sets[i][4], sets[i][2], sets[i][3], *tile),
                                   64, 15, device, rotate=rotate)
                label = f"{name}_{tile[0]}x{tile[1]}"
                row[label] = {"us": round(us, 3), "rel_err": err}
                pct = f", {100 * row['floor_us'] / us:.0f}% of the copy rate" if rate else ""
                print(f"B={B:<4d} {label:22s} {us:8.2f} us (rel err {err:.1e}{pct})", flush=True)
                del sets
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "conv_decode_probe.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
