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

Used by tests/test_gpu_speculative.py (a dense bf16 model: every row within the parity
tolerance) and benchmarks/spec_bench.py (bench size, reported). Slots and pages are freed after.
"""

from __future__ import annotations

import torch

from compiler.splitops import Mode
from runtime.batch import SeqState, build_step, commit_step

__all__ = ["verify_against_decode"]


def _host_logits(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().cpu()  # a copy: a replayed graph's outputs are rewritten by its next replay


def verify_against_decode(runner, vocab_size: int, history_lens: list[int], draft_tokens: int,
                          generator: torch.Generator) -> dict:
    """{"rows": [{"request", "row", "rel_err", "argmax_equal", "margin"}], "keys": [verify key, decode keys]}."""
    kv, st, width = runner.kv_pool, runner.state_pool, draft_tokens + 1
    B = len(history_lens)
    twins = [SeqState(st.alloc()) for _ in range(2 * B)]
    a, b = twins[:B], twins[B:]
    try:
        history = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in history_lens]
        prefill = list(zip(a + b, history + history))
        runner.run(build_step(prefill, kv, "cpu", max_pages=runner.max_pages), None)
        commit_step(prefill)
        tokens = [torch.randint(1, vocab_size, (width,), generator=generator).tolist() for _ in range(B)]
        items = list(zip(a, tokens))
        step, verify_key = runner.build(items, mode=Mode.TARGET_VERIFY, logits_rows=[width] * B)
        verify = _host_logits(runner.run(step, verify_key)).view(B, width, -1)
        commit_step(items)
        rows, keys = [], [verify_key]
        for j in range(width):
            items = [(s, [t[j]]) for s, t in zip(b, tokens)]
            step, key = runner.build(items)
            decode = _host_logits(runner.run(step, key))
            commit_step(items)
            keys.append(key)
            top2 = torch.log_softmax(decode, dim=-1).topk(2, dim=-1).values
            for i in range(B):
                got, want = verify[i, j], decode[i]
                rows.append({"request": i, "row": j,
                             "rel_err": float((got - want).norm() / want.norm().clamp_min(1e-30)),
                             "argmax_equal": int(got.argmax()) == int(want.argmax()),
                             "margin": float(top2[i, 0] - top2[i, 1])})
        return {"rows": rows, "keys": keys}
    finally:
        for seq in twins:
            kv.free(seq.pages)
            st.free(seq.slot)
