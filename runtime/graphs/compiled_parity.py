"""Compiled glue against traced glue: the start-up check that the bundle's pieces compute what the graph says.

The start-up parity check (runtime/graphs/startup_parity.py) compares padded replays with eager runs
of the same glue; it cannot see a compiled piece that differs from the traced graph, since both of
its sides run the compiled piece. This check compares with the traced glue itself:

1. A CacheWatch is made over the real requests' slots and pages (runtime/graphs/parity.py).
2. The step runs with the traced glue (`ProgramRunner(..., compiled=False)`), every op's inputs and
   `out` recorded (OpTrace): the reference.
3. The caches are restored; the step runs with the compiled pieces under TeacherForcing: each op
   gets the reference's inputs, and records how far the inputs the compiled glue computed for it
   are from them. That is the relative error of each glue output an op reads, per op, free of
   what earlier ops did differently (not of the rounding the glue carries past them: the residual
   stream); then the logits, and the states and KV written.
4. Anything beyond the compute dtype's tolerance (`PARITY_RTOL`; docs/DESIGN.md states it; glue
   and logits by the drift rule, `parity.beyond_drift`) raises ParityError naming the layer and
   op; otherwise the report lists every op's error.

`check_compiled_start_up` runs it on an extend step and a decode step of a few fresh requests: what
`hgc run` / `hgc serve` do at start-up on a device without CUDA graphs, for the main program and,
with speculative decoding, the draft program. The start-up parity check calls
`compare_compiled` on each captured key's padded step. It does not capture, and does not decide
what is compiled (the bundle does).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from compiler.splitops.artifact import PROGRAM_INPUTS
from runtime.backends.protocol import plan_eager_step
from runtime.cache.batch import SeqState, StepInputs, build_step, commit_step
from runtime.graphs.parity import (CacheWatch, OpTrace, ParityError, TeacherForcing, beyond_drift, first_glue_fault, rel_err,
                            rtol_for)
from runtime.graphs.staging import hidden_input_spec, step_on_device

__all__ = ["compare_compiled", "check_compiled_start_up"]


def _run(program, ops, step: StepInputs, chunk_size: int, compiled: bool, *, observer=None, intercept=None):
    inputs, ctx = step_on_device(step, program.device, PROGRAM_INPUTS[program.name])
    plan_eager_step(ops.backend, ctx, chunk_size)
    ops.observer, ops.intercept = observer, intercept
    try:
        with ops.step(ctx), torch.no_grad():
            return program.user_outputs(ctx.mode, inputs, compiled=compiled)[0].clone()
    finally:
        ops.observer = ops.intercept = None


def compare_compiled(program, ops, kv_pool, state_pool, step: StepInputs, slots: list[int], pages: list[int],
                     chunk_size: int, rtol: Optional[float] = None, verify_rows: int = 0) -> dict:
    """Steps 1-4 on one built step; the caches are left as the compiled run wrote them.
    verify_rows: the real requests of a target_verify step, whose intermediate states are
    compared too (runtime/graphs/parity.py CacheWatch)."""
    rows = step.ctx.num_real_tokens
    watch = CacheWatch(kv_pool, state_pool, slots, pages, verify_rows=verify_rows)
    reference = OpTrace(rows, inputs=True)
    ref_logits = _run(program, ops, step, chunk_size, compiled=False, observer=reference)
    ref_written = watch.written()
    watch.restore()
    if rtol is None:
        rtol = rtol_for(reference.records[0].out.dtype if reference.records else ref_logits.dtype)
    forced = TeacherForcing(reference.records)
    logits = _run(program, ops, step, chunk_size, compiled=True, intercept=forced)
    report = {"mode": step.ctx.mode.value, "rtol": rtol, "logits": rel_err(logits, ref_logits),
              "ops": [{"layer": r.layer, "op": r.op, "rel_err": e} for r, e in zip(reference.records, forced.glue)]}
    problems = []
    fault = first_glue_fault(forced.glue, rtol)  # rounding carried through the layers is allowed for (parity.py)
    if fault is not None:
        first = report["ops"][fault[0]]
        problems.append(f"first beyond it: the compiled glue before layer {first['layer']} ({first['op']}) hands it "
                        f"inputs with rel err {first['rel_err']:.3g} ({fault[1]:.3g} carried from earlier layers)")
    if beyond_drift(report["logits"], forced.carried, rtol):
        problems.append(f"logits rel err {report['logits']:.3g}")
    written = watch.differences(ref_written, watch.written(), rtol)
    if written:
        problems.append(f"written for a real request: {written}")
    if problems:
        raise ParityError(f"start-up parity, compiled pieces against the traced glue ({report['mode']}, {rows} row(s), "
                          f"tolerance {rtol:g}): {'; '.join(problems)}; refusing to serve (run with --no-compiled to "
                          f"use the traced glue)")
    report["worst_op"] = max((o["rel_err"] for o in report["ops"]), default=0.0)
    return report


def check_compiled_start_up(program, ops, kv_pool, state_pool, vocab_size: int, chunk_size: int,
                            seed: int = 0) -> list[dict]:
    """An extend step of two fresh requests, then a decode step of both, each compared (steps 1-4).
    A program that takes hidden states (the draft) gets random ones for every token."""
    generator = torch.Generator().manual_seed(seed)
    hidden = hidden_input_spec(program.program) if "hidden" in PROGRAM_INPUTS[program.name] else None
    if state_pool.num_free < 2:
        raise ParityError("start-up parity of the compiled pieces needs 2 free state slots")
    seqs = [SeqState(state_pool.alloc()) for _ in range(2)]
    try:
        reports = []
        items = [(seq, torch.randint(1, vocab_size, (n,), generator=generator).tolist())
                 for seq, n in zip(seqs, (5, 3))]
        for _ in ("extend", "decode"):
            step = build_step(items, kv_pool, "cpu")
            if hidden is not None:
                width, dtype = hidden
                step = dataclasses.replace(step, hidden=torch.randn(step.ctx.num_tokens, width,
                                                                    generator=generator).to(dtype))
            reports.append(compare_compiled(program, ops, kv_pool, state_pool, step, [s.slot for s in seqs],
                                            [p for s in seqs for p in s.pages], chunk_size))
            commit_step(items)
            items = [(seq, torch.randint(1, vocab_size, (1,), generator=generator).tolist()) for seq in seqs]
        return reports
    finally:
        for seq in seqs:
            kv_pool.free(seq.pages)
            state_pool.free(seq.slot)
