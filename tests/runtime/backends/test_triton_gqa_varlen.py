"""The Triton GQA kernel for requests of different lengths (kernels/gqa.py, `triton_gqa_attention_varlen`).

Request b owns rows query_start_loc[b] .. query_start_loc[b+1] - 1 of the step, its row r sits at
position seq_lens[b] - q_len_b + r and sees keys 0..that position; rows past query_start_loc[B]
are padding and get zeros. Every check draws fresh random inputs over a paged cache whose pages
are handed out out of order, and compares with a plain torch reference (each request's keys
gathered from its pages, causal softmax, float64) by the relative error of the norm:

1. requests of different lengths (1-row requests, fresh prompts, cached prefixes, rows crossing
   page boundaries), padded requests (no rows, no keys) and padded rows (NaN queries), a head
   group of 4 (one tile of 64 rows holds 16 rows of a request) and one of 20 with head dims 32 /
   16 (a request's rows over several row blocks); 1 and 4 splits, the launch's own count, and
   fixed splits;
2. the grid sized for a captured bucket (max_rows = the step's rows) gives an eager step's grid's
   results (max_rows = the longest request) bit for bit;
3. with fixed splits an extend row is bit for bit what a decode step at its position gives it
   (the uniform kernel; its own tests stay in test_triton_fixed_splits.py and
   test_flashinfer_backend_cpu.py);
4. what the arguments must be.

On a machine without CUDA the kernel runs in Triton's interpreter, in float32 (bf16 dots are
wrong in the interpreter); the gpu-marked tests run it compiled in bf16 at Qwen3-Next's head
geometry (16 query heads, 2 kv heads, head dim 256): against the reference, and check 3 there. The interpreter must be switched on before
triton is first imported (testkit/triton_interpreter.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402,F401

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels.gqa import triton_gqa_attention, triton_gqa_attention_varlen  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)
on_gpu = pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU (the kernel compiled)")


@dataclasses.dataclass
class Step:
    """One step over a paged cache: per real request (cached, new) tokens, padded to `seqs` requests and `rows` rows."""

    q: torch.Tensor  # [rows, Hq, D], NaN on padding rows
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [seqs, width] int32
    seq_lens: torch.Tensor  # [seqs] int32 (padded requests: 0)
    query_start_loc: torch.Tensor  # [seqs + 1] int32 (padded requests own no rows)
    reqs: list[tuple[int, int]]
    page: int

    @property
    def real_rows(self) -> int:
        return sum(n for _, n in self.reqs)

    def reference(self, scale: float) -> torch.Tensor:
        """Each real request's rows over its gathered keys, causal, float64; padding rows zero."""
        rows, hq, _ = self.q.shape
        hkv, dv = self.k_cache.shape[2], self.v_cache.shape[3]
        out = torch.zeros(rows, hq, dv, dtype=torch.float64, device=self.q.device)
        start = 0
        for b, (cached, new) in enumerate(self.reqs):
            j = torch.arange(cached + new, device=self.q.device)
            pages = self.page_table[b][j // self.page].long()
            k = self.k_cache[pages, j % self.page].double().repeat_interleave(hq // hkv, 1)
            v = self.v_cache[pages, j % self.page].double().repeat_interleave(hq // hkv, 1)
            q = self.q[start:start + new].double()
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            pos = cached + torch.arange(new, device=self.q.device)
            s = s.masked_fill(j[None, :] > pos[:, None], float("-inf"))
            out[start:start + new] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
            start += new
        return out


def make_step(reqs, hq, hkv, d, dv, *, seqs, rows, page=4, dtype=torch.float32, seed=0) -> Step:
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(c + n) // page) for c, n in reqs)
    num_pages = len(reqs) * width + 5
    order = torch.randperm(num_pages, generator=gen)  # pages out of order
    table = torch.zeros(seqs, width, dtype=torch.int32)
    at = 0
    for b, (c, n) in enumerate(reqs):
        count = -(-(c + n) // page)
        table[b, :count] = order[at:at + count].to(torch.int32)
        at += count
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    starts += [starts[-1]] * (seqs - len(reqs))
    lens = [c + n for c, n in reqs] + [0] * (seqs - len(reqs))
    q = torch.randn(rows, hq, d, generator=gen)
    q[starts[-1]:] = float("nan")  # padding rows: nothing may read them into a real row
    to = dict(device=DEVICE)
    return Step(q.to(dtype).to(**to), torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype).to(**to),
                torch.randn(num_pages, page, hkv, dv, generator=gen).to(dtype).to(**to), table.to(**to),
                torch.tensor(lens, dtype=torch.int32, **to), torch.tensor(starts, dtype=torch.int32, **to),
                list(reqs), page)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# (cached, new) per request: a fresh prompt, a 1-row request (a decode row of a mixed step), a
# prefix-cache hit's tail crossing pages, another 1-row request after a long cache, a fresh request
# of one token
REQUESTS = [(0, 11), (9, 1), (6, 7), (21, 1), (0, 1), (13, 5)]
SCALE = 0.3


@in_process
@pytest.mark.parametrize("hq, hkv, d, dv", [(8, 2, 16, 16), (20, 1, 32, 16)], ids=["group4", "group20"])
@pytest.mark.parametrize("splits", [dict(num_splits=1), dict(num_splits=4), {},
                                    dict(fixed_splits=True, split_tokens=16)], ids=["1", "4", "auto", "fixed"])
def test_requests_of_different_lengths_match_the_reference(hq, hkv, d, dv, splits):
    step = make_step(REQUESTS, hq, hkv, d, dv, seqs=len(REQUESTS) + 2, rows=step_rows(REQUESTS) + 7)
    out = torch.full(step.q.shape[:2] + (dv,), float("nan"), device=DEVICE)
    triton_gqa_attention_varlen(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens,
                                step.query_start_loc, out, SCALE, block_n=16, **splits)
    want, real = step.reference(SCALE), step.real_rows
    assert rel_err(out[:real], want[:real]) < 1e-5
    assert torch.isfinite(out).all() and out[real:].eq(0).all(), "padding rows: zeros"


def step_rows(reqs) -> int:
    return sum(n for _, n in reqs)


@in_process
def test_a_bucket_sized_grid_gives_the_eager_grid_bit_for_bit():
    """A captured bucket launches row blocks for its T rows (max_rows = T); an eager step for its
    longest request: the programs past a request's rows return at once, the rest compute alike."""
    step = make_step(REQUESTS, 8, 2, 16, 16, seqs=len(REQUESTS), rows=step_rows(REQUESTS), seed=3)
    outs = []
    for max_rows in (max(n for _, n in REQUESTS), None):
        out = torch.zeros(step.q.shape[:2] + (16,), device=DEVICE)
        triton_gqa_attention_varlen(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens,
                                    step.query_start_loc, out, SCALE, max_rows=max_rows, num_splits=2, block_n=16)
        outs.append(out)
    assert torch.equal(*outs)


@in_process
@pytest.mark.parametrize("group, hkv, splits", [(4, 2, dict(num_splits=2)),
                                                (20, 1, dict(fixed_splits=True, split_tokens=16))],
                         ids=["group4-2", "group20-fixed"])
def test_a_flat_grid_gives_the_request_grid_bit_for_bit(group, hkv, splits):
    """flat_grid: one program per row block the step's rows can fill, each finding its request by a
    binary search over the offsets. In a bucket laid out for more requests than the step has (empty
    requests, then the padding rows) and with a request of one row, its output is the request
    grid's, bit for bit, and the reference's. Two kv heads with a group of 4; one with a group of
    20 (its rows fill several row blocks a request, each kv head's alike)."""
    reqs = REQUESTS + [(0, 0), (0, 0), (3, 0)]  # three empty requests (one with cached tokens), as a bucket pads
    step = make_step(reqs, hkv * group, hkv, 16, 16, seqs=len(reqs) + 1, rows=step_rows(reqs) + 5, seed=6)
    outs = []
    for flat in (False, True):
        out = torch.full(step.q.shape[:2] + (16,), float("nan"), device=DEVICE)
        triton_gqa_attention_varlen(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens,
                                    step.query_start_loc, out, SCALE, block_n=16, flat_grid=flat, **splits)
        outs.append(out)
    assert torch.equal(*outs)
    real = step.real_rows
    assert rel_err(outs[1][:real], step.reference(SCALE)[:real]) < 1e-5 and outs[1][real:].eq(0).all()


def check_extend_rows_are_decode_rows(step: Step, fixed: dict, scale: float) -> None:
    """Every real row of `step` through the varlen kernel, bit for bit the decode step (the uniform
    kernel, n = 1) of that row at its position."""
    out = torch.zeros(step.q.shape[:2] + (step.v_cache.shape[3],), dtype=step.q.dtype, device=DEVICE)
    triton_gqa_attention_varlen(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens,
                                step.query_start_loc, out, scale, **fixed)
    row = 0
    for b, (cached, new) in enumerate(step.reqs):
        for r in range(new):
            alone = torch.zeros_like(out[:1])
            triton_gqa_attention(step.q[row:row + 1], step.k_cache, step.v_cache, step.page_table[b:b + 1],
                                 torch.tensor([cached + r + 1], dtype=torch.int32, device=DEVICE), 1, alone, scale,
                                 **fixed)
            assert torch.equal(alone[0], out[row]), (b, r)
            row += 1


@in_process
def test_with_fixed_splits_an_extend_row_is_the_decode_rows_bits():
    """Fixed splits walk fixed chunks in a fixed order with the same tile: a row of an extend step
    comes out bit for bit as the decode step at its position gives it (the uniform kernel, n = 1),
    whatever row of a tile it sits at. Chunks of 16 keys, so the longest request crosses several."""
    step = make_step(REQUESTS, 8, 2, 16, 16, seqs=len(REQUESTS), rows=step_rows(REQUESTS), seed=4)
    check_extend_rows_are_decode_rows(step, dict(fixed_splits=True, split_tokens=16, block_n=16), SCALE)


def test_the_arguments_are_checked():
    step = make_step(REQUESTS[:2], 8, 2, 16, 16, seqs=2, rows=12)
    out = torch.zeros(12, 8, 16, device=DEVICE)
    args = (step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens)
    with pytest.raises(ValueError, match=r"2 requests need 3 query offsets and 2 sequence lengths, got 2 and 2"):
        triton_gqa_attention_varlen(*args, step.query_start_loc[:2], out, SCALE)
    with pytest.raises(ValueError, match="max_rows 13 for a step of 12 rows"):
        triton_gqa_attention_varlen(*args, step.query_start_loc, out, SCALE, max_rows=13)
    with pytest.raises(ValueError, match="powers of two >= 16, not 24"):
        triton_gqa_attention_varlen(torch.zeros(1, 2, 24), torch.zeros(1, 4, 1, 24), torch.zeros(1, 4, 1, 24),
                                    torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                    torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, 2, 24), 1.0)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fixed", [False, True], ids=["auto", "fixed"])
def test_bf16_at_qwen3_next_heads_on_the_gpu(fixed):
    """Compiled, bf16, 16 query and 2 kv heads of 256, pages of 16: a prompt of 200 tokens, a
    32-token tail over a 1000-token prefix, decode rows of a mixed step, padded requests and rows."""
    reqs = [(0, 200), (1000, 32), (77, 1), (400, 1), (0, 17)]
    step = make_step(reqs, 16, 2, 256, 256, seqs=8, rows=256, page=16, dtype=torch.bfloat16, seed=5)
    out = torch.full((256, 16, 256), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_gqa_attention_varlen(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_lens,
                                step.query_start_loc, out, 256 ** -0.5, fixed_splits=fixed)
    real = step.real_rows
    assert rel_err(out[:real], step.reference(256 ** -0.5)[:real]) < 1e-2
    assert torch.isfinite(out).all() and out[real:].eq(0).all()


@pytest.mark.gpu
@on_gpu
def test_bf16_extend_rows_with_fixed_splits_are_the_decode_rows_bits_on_the_gpu():
    """On the device's tensor-core tiles, in bf16, with the real chunk of keys (SPLIT_TOKENS): the
    rows of a prompt, a prefix hit's tail past the first chunks and a mixed step's decode row."""
    reqs = [(0, 70), (600, 24), (300, 1)]
    step = make_step(reqs, 16, 2, 256, 256, seqs=3, rows=95, page=16, dtype=torch.bfloat16, seed=6)
    check_extend_rows_are_decode_rows(step, dict(fixed_splits=True), 256 ** -0.5)
