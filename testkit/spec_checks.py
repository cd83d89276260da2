"""A target_verify step's rows against the decode steps they stand for, on any device and dtype.

Speculative decoding is exact only if row j of a verify step (the request's last token and
drafts d_1 .. d_D fed at once) gives the logits a decode step gives after the same j tokens.
`verify_against_decode` measures that directly on a GraphRunner of the main program, so a
fault in a backend's verify path (wrong state, wrong KV, wrong rows) shows as a large relative
error on every row, while bf16 rounding of differently shaped kernels stays at a few 1e-3 (a
random-weight MoE router that flips an expert on that rounding moves a row further; the decode
row's top-2 margin then says whether an argmax flip was a near tie):

1. Twin requests a_i and b_i get the same random history and are prefilled together in one
   eager step, so both hold the same KV and linear states.
2. a_i: one target_verify step of D + 1 random tokens. b_i: D + 1 decode steps of the same
   tokens, one at a time. Both through `runner.build` / `runner.run`: captured graphs where the
   runner has a key for the step, eager otherwise.
3. Per request and row: ||verify - decode|| / ||decode|| of the logits (float32), whether the
   argmaxes agree, and the decode row's margin between its two most likely tokens (log-probs).

With `trace_ops=True` every step runs eagerly (the same kernels a replay launches) under a
runtime/graphs/parity.OpTrace that keeps each op's per-token inputs and output, and each row also says
where its bits first part from the decode step's (`parting`): walking the ops in order, the first
op handed other inputs (the glue before it computed them differently: a GEMM, a norm) or the first
op that gave another output from the same inputs (its kernel, or the state or KV it read); None
where every op agrees bit for bit.

Used by tests/gpu/test_gpu_speculative.py (a dense bf16 model: every row within the parity
tolerance) and benchmarks/serving/spec_bench.py (bench size, reported). Slots and pages are freed after.
"""

from __future__ import annotations

import torch

from compiler.splitops import Mode
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.graphs.parity import OpRecord, OpTrace
from testkit.position_trace import entries_apart

__all__ = ["first_parting", "verify_against_decode"]


def _host_logits(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().cpu()  # a copy: a replayed graph's outputs are rewritten by its next replay


def verify_against_decode(runner, vocab_size: int, history_lens: list[int], draft_tokens: int,
                          generator: torch.Generator, trace_ops: bool = False) -> dict:
    """{"rows": [{"request", "row", "rel_err", "argmax_equal", "margin"(, "parting")}],
    "keys": [verify key, decode keys]} (keys None: eager; every key with trace_ops)."""
    kv, st, width = runner.kv_pool, runner.state_pool, draft_tokens + 1
    B = len(history_lens)
    twins = [SeqState(st.alloc()) for _ in range(2 * B)]
    a, b = twins[:B], twins[B:]
    traces = []  # with trace_ops: the verify step's OpTrace, then each decode step's

    def run(items, mode=None, logits_rows=None):
        """One step through the runner: its logits on the host and its key."""
        if not trace_ops:
            step, key = runner.build(items, mode=mode, logits_rows=logits_rows)
            logits = _host_logits(runner.run(step, key))
        else:
            step, key = build_step(items, kv, "cpu", mode=mode, max_pages=runner.max_pages,
                                   logits_rows=logits_rows), None
            traces.append(OpTrace(sum(len(t) for _, t in items), inputs=True))
            runner.ops.observer = traces[-1]
            try:
                logits = _host_logits(runner.run(step, None))
            finally:
                runner.ops.observer = None
        commit_step(items)
        return logits, key

    try:
        history = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in history_lens]
        prefill = list(zip(a + b, history + history))
        runner.run(build_step(prefill, kv, "cpu", max_pages=runner.max_pages), None)
        commit_step(prefill)
        tokens = [torch.randint(1, vocab_size, (width,), generator=generator).tolist() for _ in range(B)]
        verify, verify_key = run(list(zip(a, tokens)), mode=Mode.TARGET_VERIFY, logits_rows=[width] * B)
        verify = verify.view(B, width, -1)
        rows, keys = [], [verify_key]
        for j in range(width):
            decode, key = run([(s, [t[j]]) for s, t in zip(b, tokens)])
            keys.append(key)
            top2 = torch.log_softmax(decode, dim=-1).topk(2, dim=-1).values
            for i in range(B):
                got, want = verify[i, j], decode[i]
                rows.append({"request": i, "row": j,
                             "rel_err": float((got - want).norm() / want.norm().clamp_min(1e-30)),
                             "argmax_equal": int(got.argmax()) == int(want.argmax()),
                             "margin": float(top2[i, 0] - top2[i, 1])})
                if trace_ops:
                    rows[-1]["parting"] = first_parting(traces[0].records, i * width + j, traces[1 + j].records, i)
        return {"rows": rows, "keys": keys}
    finally:
        for seq in twins:
            kv.free(seq.pages)
            st.free(seq.slot)


def first_parting(verify_ops: list[OpRecord], verify_row: int, decode_ops: list[OpRecord],
                  decode_row: int) -> dict | None:
    """Where a verify row's bits first part from its decode step's, walking the step's ops in order
    (testkit/position_trace.entries_apart): {"layer", "op", "index" (the op's place in the step),
    "at": "input NAME" (the glue before the op handed it another per-token input NAME) or "output"
    (the op gave another output from the same inputs), "rel_err" there}; None when every op's
    inputs and output agree bit for bit."""
    a, b = _entries(verify_ops, verify_row), _entries(decode_ops, decode_row)
    found = entries_apart(a, b, torch.equal)
    if found is not None and found.get("other_ops"):
        raise ValueError("the verify and decode steps called other ops: no op-by-op comparison")
    if found is None:
        return None
    k = found.pop("entry")
    got, want = a[k][3].float(), b[k][3].float()
    return {**found, "rel_err": float((got - want).norm() / want.norm().clamp_min(1e-30))}


def _entries(ops: list[OpRecord], row: int) -> list[tuple[int, str, str, torch.Tensor]]:
    """One row of a step's op records as entries_apart's (layer, op, at, tensor): inputs, then output."""
    return [entry for r in ops for entry in [*((r.layer, r.op, f"input {arg}", t[row]) for arg, t in r.inputs.items()),
                                             (r.layer, r.op, "output", r.out[row])]]
