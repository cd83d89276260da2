"""Whether Triton pipelines a GDN decode recurrence that walks several state tiles a program, compiled
for sm90 on any machine (no GPU: testkit/sm90.py).

The runtime's `_recurrent_decode_kernel` (runtime/backends/kernels/linear.py) is one program a
(request, value head, value tile): it loads its state tile, computes, stores, and has nothing in
flight while it computes. Over bfloat16 states (`hgc compile --state-dtype bfloat16`) an SM holds 4
such programs, 64 KiB of state loading at once, and on an H200 the recurrence took the H100's time on
1.4 times the copy rate (docs/DESIGN.md "Recurrent states in bfloat16"). A program that walks tiles
in a `tl.range` loop with num_stages >= 2 could load the next tile's state (into shared memory, by
cp.async) while it computes this one. `_decode_walk_kernel` here is that loop over the project's
own step (`scalar_decay_step`), at bench qwen3_next's GDN dims (32 value heads of 128, one value head
a key head, 64 value columns a tile, 4 warps), compiled per state dtype and stage count; for each,
cuobjdump's registers and spills, the compile's shared memory, the programs an SM holds, and the
SASS counts of LDGSTS (cp.async: a pipelined load) and LDG (plain loads). Nothing is run or timed:
a GPU measures it before the runtime takes it.

    python3 benchmarks/probes/decode_walk_probe.py --out /tmp/walk

Writes OUT/decode_walk_probe.json and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the GPU machine's Triton compiles (fused multiply-adds)
os.environ["TRITON_INTERPRET"] = "0"  # compiled, never run: a test's interpreter setting must not reach triton.jit

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from runtime.backends.kernels.linear import scalar_decay_step  # noqa: E402
from testkit.sm90 import Launch, compile_sm90, programs_per_sm, resources  # noqa: E402

HV, DK, DV, BV, WARPS = 32, 128, 128, 64, 4
REQUESTS = 128


@triton.jit
def _decode_walk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, n_tiles,
                        HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                        STAGES: tl.constexpr):
    """Tiles t = (request, head, value tile) from program_id, a grid's width apart, each as the
    runtime's decode kernel computes one (log-decay g, beta, q with the output scale applied)."""
    TILES_V: tl.constexpr = DV // BV
    offs_k = tl.arange(0, DK)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        row = t // (HV * TILES_V)
        head = t % (HV * TILES_V) // TILES_V
        offs_v = t % TILES_V * BV + tl.arange(0, BV)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        s_ptrs = state_ptr + slot * (HV * DK * DV) + head * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(s_ptrs).to(tl.float32)
        q = tl.load(q_ptr + (row * HV + head) * DK + offs_k).to(tl.float32)
        k = tl.load(k_ptr + (row * HV + head) * DK + offs_k).to(tl.float32)
        v = tl.load(v_ptr + (row * HV + head) * DV + offs_v).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + row * HV + head).to(tl.float32))
        beta = tl.load(beta_ptr + row * HV + head).to(tl.float32)
        s, o = scalar_decay_step(s, q, k, v, decay, beta, DELTA=True)
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty))
        tl.store(out_ptr + (row * HV + head) * DV + offs_v, o.to(out_ptr.dtype.element_ty))


def compiled(state: str, stages: int) -> dict:
    tensor = lambda kind: {"ptr": kind, "aligned": True}  # noqa: E731
    args = dict(q_ptr=tensor("*bf16"), k_ptr=tensor("*bf16"), v_ptr=tensor("*bf16"), g_ptr=tensor("*fp32"),
                beta_ptr=tensor("*bf16"), out_ptr=tensor("*bf16"), state_ptr=tensor(state), slots_ptr=tensor("*i64"),
                n_tiles=REQUESTS * HV * (DV // BV), HV=HV, DK=DK, DV=DV, BV=BV, STAGES=stages)
    kernel = compile_sm90(Launch(__name__, "_decode_walk_kernel", args, {"num_warps": WARPS, "num_stages": stages},
                                 [132]))
    with tempfile.TemporaryDirectory() as work:
        found = resources(kernel.asm["cubin"], work)
    shared = int(kernel.metadata.shared)
    fits = programs_per_sm(found["registers"], shared, WARPS)
    return {"state": state, "stages": stages, "registers": found["registers"], "spill_bytes": found["local_bytes"],
            "shared_bytes": shared, "programs_per_sm": fits["programs"], "limited_by": fits["limit"],
            "LDGSTS": found["sass"]["LDGSTS"], "LDG": found["sass"]["LDG"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    rows = [compiled(state, stages) for state in ("*fp32", "*bf16") for stages in (1, 2, 3)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_walk_probe.json").write_text(json.dumps({"target": "sm90", "triton": triton.__version__,
                                                                   "rows": rows}, indent=1))
    print(f"{'state':6s} {'stages':>6} {'regs':>4} {'spill':>5} {'smem KiB':>8} {'per SM':>6} {'by':>9} {'LDGSTS':>6} "
          f"{'LDG':>4}")
    for r in rows:
        print(f"{r['state']:6s} {r['stages']:>6} {r['registers']:>4} {r['spill_bytes']:>5} "
              f"{r['shared_bytes'] / 1024:>8.1f} {r['programs_per_sm']:>6} {r['limited_by']:>9} {r['LDGSTS']:>6} "
              f"{r['LDG']:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
