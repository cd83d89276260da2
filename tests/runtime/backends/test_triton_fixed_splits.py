"""Fixed splits of the Triton split-KV attention kernels (runtime/backends/kernels/split_kv.py).

With `fixed_splits=True` a row's output must depend only on its query, its keys and its position.
Every check draws fresh random inputs over a paged cache whose pages are handed out out of order,
and follows one request A through steps of other shapes, its query rows the same in each:

1. GQA from the page table (triton_gqa.py), MLA from the page table and from row arrays
   (triton_mla.py): fixed splits against a float64 reference attention (||x - ref|| / ||ref||)
   and against the default mode; then bit for bit (torch.equal), A's row at position p in
   (a) a decode step of A alone, (b) a decode step of three requests (A between two others of
   other lengths), (c) a verify step of n = 4 rows per request (its row at p, against the decode
   step whose length ends at p), and for MLA (d) an extend step from row arrays. A's positions
   straddle the end of the first round of programs (MAX_SPLITS chunks): the CPU tests pass chunks
   of 16 keys (SPLIT_TOKENS is 256), so a few hundred keys cross more than MAX_SPLITS chunks. The
   default mode gives a verify step's earlier rows other bits (so the check can fail).
2. The combine pass: a row's extra empty splits (fixed splits always launch MAX_SPLITS) leave its
   result bit for bit, and their outputs are never read.
3. The arguments: num_splits with fixed splits, a chunk that is no multiple of the key tile, or a
   chunk without fixed splits, are refused.
4. The backend option kv_splits ("auto", "fixed") of FlashInferAttentionBackend and
   TritonMLABackend: declared with "auto" the default, refused where a FlashInfer kernel would
   run, passed to the kernels: the same row the same bits through the backends' steps.

On a machine without CUDA the kernels run in Triton's interpreter, in float32 (bf16 dots are
wrong in the interpreter) at small dims so the file stays quick. The gpu-marked tests run the same
checks compiled at real dims in bf16 (GQA head dims 128 and 256 with 16 query and 2 kv heads, MLA
rank 512 and rope 64) with the real SPLIT_TOKENS; there bit equality also says that a decode row
and a verify row come out of the tensor-core tiles alike at different rows of a tile.
The interpreter must be switched on before triton is first imported (testkit/triton_interpreter.py).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402,F401

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec  # noqa: E402
from runtime.backends.kernels import gqa as triton_gqa, mla as triton_mla, split_kv as triton_split_kv  # noqa: E402
from runtime.backends import triton_mla as triton_mla_backend
from runtime.backends.flashinfer_attention import FlashInferAttentionBackend  # noqa: E402
from runtime.backends.kernels.gqa import triton_gqa_attention  # noqa: E402
from runtime.backends.kernels.mla import (triton_mla_attention, triton_mla_attention_paged,  # noqa: E402
                                          triton_mla_attention_varlen)
from runtime.backends.triton_mla import TritonMLABackend  # noqa: E402
from runtime.backends.kernels.sm_count import CPU_STAND_IN_SMS  # noqa: E402
from runtime.backends.kernels.split_kv import MAX_SPLITS, SPLIT_TOKENS, combine_splits, num_splits_for  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.cache.kv_pool import KVPool  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

ON_GPU = not INTERPRETED
on_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the kernels compiled)")

PAGE = 16
N_VERIFY = 4  # rows per request of the verify step: 3 drafts
A, X, Y, Z = range(4)  # the followed request, its two decode batch mates, its verify mate
MLA_SCALE = (128 + 64) ** -0.5


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@dataclasses.dataclass(frozen=True)
class Case:
    """One geometry of the checks: dtype, chunk, the lengths of X, Y and Z, A's positions."""

    dtype: torch.dtype
    split_tokens: Optional[int]  # None: SPLIT_TOKENS
    others: tuple[int, int, int]  # the lengths of X, Y, Z
    tol: float  # ||x - ref|| / ||ref|| against the reference and against the default mode
    seed: int

    @property
    def positions(self) -> list[int]:
        """A's rows: a verify step's n, straddling the first key past MAX_SPLITS chunks."""
        last = MAX_SPLITS * (self.split_tokens or SPLIT_TOKENS) + 1
        return list(range(last - N_VERIFY + 1, last + 1))

    def length(self, req: int) -> int:
        return self.positions[-1] + 1 if req == A else self.others[req - 1]

    @property
    def fixed(self) -> dict:
        return dict(fixed_splits=True, split_tokens=self.split_tokens)


CPU_CASE = Case(torch.float32, 16, (37, 100, 40), tol=1e-5, seed=1)
GPU_CASE = Case(torch.bfloat16, None, (37, 3000, 500), tol=1e-2, seed=2)


class Paged:
    """A paged cache (entry name -> per-token shape) holding all four requests, pages out of order."""

    def __init__(self, case: Case, entries: dict, gen: torch.Generator):
        width = -(-max(case.length(r) for r in range(4)) // PAGE)
        pages = 4 * width + 3
        self.table = torch.randperm(pages, generator=gen)[:4 * width].reshape(4, width).to(torch.int32).to(DEVICE)
        self.cache = {name: torch.randn(pages, PAGE, *shape, generator=gen).to(case.dtype).to(DEVICE)
                      for name, shape in entries.items()}

    def keys(self, name: str, req: int, count: int) -> torch.Tensor:
        """Request req's first `count` tokens of entry `name`, in position order, float64."""
        j = torch.arange(count, device=DEVICE)
        return self.cache[name][self.table[req][j // PAGE].long(), j % PAGE].double()

    def step(self, reqs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(page table, sequence lengths) of a step of (request, length) pairs."""
        return (self.table[[r for r, _ in reqs]].contiguous(),
                torch.tensor([n for _, n in reqs], dtype=torch.int32, device=DEVICE))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q [H, Dk]; keys [L, Hkv, Dk]; values [L, Hkv, Dv] -> [H, Dv], float64."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, -1)
    return torch.einsum("hl,lhd->hd", w, v)


def _randn(gen: torch.Generator, case: Case, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(case.dtype).to(DEVICE)


def _verify_rows(case: Case) -> list[tuple[int, int]]:
    """(request, position) of each row of the verify step: A's n rows, then Z's."""
    return [(r, case.length(r) - N_VERIFY + i) for r in (A, Z) for i in range(N_VERIFY)]


def _same_bits(case: Case, alone: list[torch.Tensor], **steps: list[torch.Tensor]) -> None:
    """A's row at each position is the same bits in every step that holds it as alone."""
    for name, rows in steps.items():
        for p, one, other in zip(case.positions, alone, rows):
            diff = float((one.float() - other.float()).abs().max())
            assert torch.equal(one, other), f"{name}: A's row at {p} is not a lone decode's (max |diff| {diff:.3g})"


# -- 1. the kernels ---------------------------------------------------------------------------------


def check_gqa(case: Case, hq: int, hkv: int, d: int, block_n: Optional[int] = None):
    """The checks of section 1; returns (A's first row decoded alone, the default mode's verify
    row at that position: its keys split by the step's last row)."""
    gen = torch.Generator().manual_seed(case.seed)
    paged = Paged(case, {"k": (hkv, d), "v": (hkv, d)}, gen)
    scale = d ** -0.5
    qa = _randn(gen, case, N_VERIFY, hq, d)  # A's query row at each of its positions

    def run(q, reqs, n, **mode):
        table, lens = paged.step(reqs)
        out = torch.full((q.shape[0], hq, d), float("nan"), dtype=case.dtype, device=DEVICE)
        triton_gqa_attention(q, paged.cache["k"], paged.cache["v"], table, lens, n, out, scale, block_n=block_n,
                             **mode)
        return out

    alone = [run(qa[i:i + 1], [(A, p + 1)], 1, **case.fixed)[0] for i, p in enumerate(case.positions)]
    batch = [run(torch.cat([_randn(gen, case, 1, hq, d), qa[i:i + 1], _randn(gen, case, 1, hq, d)]),
                 [(X, case.length(X)), (A, p + 1), (Y, case.length(Y))], 1, **case.fixed)[1]
             for i, p in enumerate(case.positions)]
    q = torch.cat([qa, _randn(gen, case, N_VERIFY, hq, d)])
    reqs = [(A, case.length(A)), (Z, case.length(Z))]
    verify = run(q, reqs, N_VERIFY, **case.fixed)
    _same_bits(case, alone, decode_of_three=batch, verify=list(verify[:N_VERIFY]))

    ref = torch.stack([_attend(q[t], paged.keys("k", r, p + 1), paged.keys("v", r, p + 1), scale)
                       for t, (r, p) in enumerate(_verify_rows(case))])
    default = run(q, reqs, N_VERIFY)
    assert rel_err(verify, ref) < case.tol and rel_err(verify, default) < case.tol
    return alone[0], default[0]


def check_mla(case: Case, h: int, r: int, p: int, block_n: int = 32):
    """The checks of section 1, from the page table and from row arrays; returns (A's first row
    decoded alone, the default mode's row there in a step of 17 rows or more: 16 splits)."""
    gen = torch.Generator().manual_seed(case.seed)
    paged = Paged(case, {"latent": (r + p,)}, gen)
    lat = paged.cache["latent"]
    ckv, kpe = lat[..., :r], lat[..., r:]
    qa = (_randn(gen, case, N_VERIFY, h, r), _randn(gen, case, N_VERIFY, h, p))  # A's rows: latent, rope

    def fresh(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _randn(gen, case, rows, h, r), _randn(gen, case, rows, h, p)

    def out_for(q):
        return torch.full(q[0].shape, float("nan"), dtype=case.dtype, device=DEVICE)

    def from_table(q, reqs, n, **mode):
        table, lens = paged.step(reqs)
        out = out_for(q)
        triton_mla_attention_paged(*q, ckv, kpe, table, lens, n, out, MLA_SCALE, block_n=block_n, **mode)
        return out

    def from_rows(q, rows, **mode):  # rows: (request, position) of each query row, any step
        reqs = list(dict.fromkeys(req for req, _ in rows))
        width = paged.table.shape[1]
        kv_indptr = torch.arange(len(reqs) + 1, dtype=torch.int32, device=DEVICE) * width
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        out = out_for(q)
        triton_mla_attention(*q, ckv, kpe, kv_indptr, paged.table[reqs].reshape(-1).contiguous(),
                             as_i32([reqs.index(req) for req, _ in rows]), as_i32([pos for _, pos in rows]), out,
                             MLA_SCALE, block_n=block_n, **mode)
        return out

    def one(i):
        return qa[0][i:i + 1], qa[1][i:i + 1]

    def ref(q, rows):
        return torch.stack([_attend(torch.cat([q[0][t], q[1][t]], -1), paged.keys("latent", req, pos + 1)[:, None],
                                    paged.keys("latent", req, pos + 1)[:, None, :r], MLA_SCALE)
                            for t, (req, pos) in enumerate(rows)])

    alone = [from_table(one(i), [(A, pos + 1)], 1, **case.fixed)[0] for i, pos in enumerate(case.positions)]
    batch = []
    for i, pos in enumerate(case.positions):
        x, y = fresh(1), fresh(1)
        q = tuple(torch.cat([a, b, c]) for a, b, c in zip(x, one(i), y))
        batch.append(from_table(q, [(X, case.length(X)), (A, pos + 1), (Y, case.length(Y))], 1, **case.fixed)[1])
    q = tuple(torch.cat(pair) for pair in zip(qa, fresh(N_VERIFY)))
    reqs = [(A, case.length(A)), (Z, case.length(Z))]
    verify = from_table(q, reqs, N_VERIFY, **case.fixed)
    # An extend step from row arrays: X's first two rows, then A's (a mixed step's layout).
    rows = [(X, 0), (X, 1)] + [(A, pos) for pos in case.positions]
    extend_q = tuple(torch.cat(pair) for pair in zip(fresh(2), qa))
    extend = from_rows(extend_q, rows, **case.fixed)

    def from_offsets(q, reqs, starts, **mode):  # rows past starts[-1]: padding
        table, lens = paged.step(reqs)
        out = out_for(q)
        triton_mla_attention_varlen(*q, ckv, kpe, table, lens, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                                    out, MLA_SCALE, block_n=block_n, **mode)
        return out

    # The same extend step from the page table and query offsets, as a captured bucket reads it:
    # two padding rows after the step's, which see no key and come out zero.
    varlen_q = tuple(torch.cat(pair) for pair in zip(extend_q, fresh(2)))
    varlen_reqs, starts = [(X, 2), (A, case.positions[-1] + 1)], [0, 2, 2 + N_VERIFY]
    varlen = from_offsets(varlen_q, varlen_reqs, starts, **case.fixed)
    assert varlen[2 + N_VERIFY:].eq(0).all(), "padding rows past the query offsets must be zero"
    _same_bits(case, alone, decode_of_three=batch, verify=list(verify[:N_VERIFY]), extend=list(extend[2:]),
               varlen_extend=list(varlen[2:2 + N_VERIFY]))
    assert torch.equal(varlen[:2], extend[:2]), "X's rows from the offsets and from the row arrays"
    assert rel_err(from_offsets(varlen_q, varlen_reqs, starts)[:2 + N_VERIFY], ref(extend_q, rows)) < case.tol

    default = from_table(q, reqs, N_VERIFY)
    assert rel_err(verify, ref(q, _verify_rows(case))) < case.tol and rel_err(verify, default) < case.tol
    assert rel_err(extend, ref(extend_q, rows)) < case.tol
    # The default mode's split count follows the step's rows (on 132 SMs: 32 up to 16 rows, then 16)
    assert num_splits_for(17, 1, CPU_STAND_IN_SMS) == 16
    # ... and the varlen kernel's prompt-sized steps aim at one wave (a 512-token request of bench
    # qwen3_next's layer: 2 kv heads x 64 row blocks)
    assert num_splits_for(1, 128, CPU_STAND_IN_SMS) == 4 and num_splits_for(1, 128, CPU_STAND_IN_SMS, waves=1) == 2
    return alone[0], from_table(one(0), [(A, case.positions[0] + 1)], 1, num_splits=16)[0]


@in_process
def test_gqa_fixed_splits_give_a_row_the_same_bits_in_decode_and_verify_steps_of_any_batch():
    alone, default = check_gqa(CPU_CASE, hq=4, hkv=1, d=16, block_n=16)
    assert not torch.equal(default, alone)  # what fixed splits are for: the check can fail


@in_process
def test_mla_fixed_splits_give_a_row_the_same_bits_in_any_step_from_the_table_or_row_arrays():
    alone, default = check_mla(CPU_CASE, h=4, r=32, p=16, block_n=16)
    assert not torch.equal(default, alone)  # what fixed splits are for: the check can fail


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gqa_fixed_splits_at_real_dims(d):
    check_gqa(GPU_CASE, hq=16, hkv=2, d=d)


@pytest.mark.gpu
@on_gpu
def test_mla_fixed_splits_at_real_dims():
    check_mla(GPU_CASE, h=16, r=512, p=64)


# -- 2. the combine pass ------------------------------------------------------------------------------


@in_process
def test_extra_empty_splits_leave_a_combined_row_bit_for_bit():
    """Five splits, merged as five and as MAX_SPLITS (27 empty ones after them, their outputs NaN:
    never read): the same bits; an empty split among the five is not read either, and a row and
    head whose splits are all empty gets zeros."""
    gen = torch.Generator().manual_seed(3)
    T, H, R, k = 3, 2, 16, 5
    lse = (4 * torch.randn(T, H, k, generator=gen))
    o = torch.randn(T, H, k, R, generator=gen)
    lse[1, 0, 2] = float("-inf")
    lse[2, 1] = float("-inf")
    o[lse == float("-inf")] = float("nan")
    padded_lse = torch.full((T, H, MAX_SPLITS), float("-inf"))
    padded_o = torch.full((T, H, MAX_SPLITS, R), float("nan"))
    padded_lse[..., :k], padded_o[..., :k, :] = lse, o

    def combine(part_lse, part_o, splits):
        out = torch.full((T, H, R), float("nan"), device=DEVICE)
        combine_splits(part_o.reshape(-1, R).to(DEVICE), part_lse.reshape(-1).to(DEVICE), out, splits)
        return out

    few, padded = combine(lse, o, k), combine(padded_lse, padded_o, MAX_SPLITS)
    assert torch.equal(few, padded)
    assert torch.isfinite(few).all() and few[2, 1].eq(0).all()
    w = torch.softmax(lse[0, 0] * torch.log(torch.tensor(2.0)), 0)  # base-2 log-sum-exps
    assert rel_err(few[0, 0].cpu(), (w[:, None] * o[0, 0]).sum(0)) < 1e-6


# -- 3. the arguments --------------------------------------------------------------------------------


def test_fixed_splits_refuse_a_split_count_and_a_chunk_off_the_key_tile():
    """Refused before any launch, for both kernels."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    q, cache = torch.zeros(1, 2, 16, device=DEVICE), torch.zeros(1, PAGE, 1, 16, device=DEVICE)
    table, lens = torch.zeros(1, 1, **i32), torch.ones(1, **i32)

    def gqa(**kw):
        triton_gqa_attention(q, cache, cache, table, lens, 1, torch.empty_like(q), 1.0, block_n=16, **kw)

    def mla(**kw):
        triton_mla_attention_paged(q, q, cache[:, :, 0], cache[:, :, 0], table, lens, 1, torch.empty_like(q), 1.0,
                                   block_n=16, **kw)

    for call in (gqa, mla):
        with pytest.raises(ValueError, match="num_splits=4 sets the default mode's split count"):
            call(fixed_splits=True, num_splits=4)
        with pytest.raises(ValueError, match="chunks of 24 keys are not a positive multiple of the 16-key tile"):
            call(fixed_splits=True, split_tokens=24)
        with pytest.raises(ValueError, match="pass fixed_splits=True"):
            call(split_tokens=32)
    assert SPLIT_TOKENS % 64 == 0 and SPLIT_TOKENS % 32 == 0, "a multiple of every default key tile"


# -- 4. the backend option ---------------------------------------------------------------------------

R_MLA, P_MLA, HQ = 32, 16, 4


class _WithoutFlashInfer:
    """The backends without FlashInfer, on the test's device: only the Triton kernels run, so a
    step must be one they serve (GQA: decode and verify; MLA: any)."""

    def _kernel_library(self):
        return None

    def _check_device(self) -> None:
        pass


class TritonOnlyFlashInfer(_WithoutFlashInfer, FlashInferAttentionBackend):
    pass


class TritonOnlyMLA(_WithoutFlashInfer, TritonMLABackend):
    pass


def _pool(kind: str) -> KVPool:
    if kind == "gqa":
        spec = LayerSpec(0, LayerKind.FULL_GQA, kv={"k": TensorSpec((1, 16), "float32"),
                                                    "v": TensorSpec((1, 16), "float32")})
    else:
        spec = LayerSpec(0, LayerKind.FULL_MLA, kv={"latent": TensorSpec((R_MLA + P_MLA,), "float32")})
    pool = KVPool(LayerRegistry([spec]), 40, PAGE, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    for t in pool.layer(0).values():  # stands in for every request's cached tokens
        t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def test_kv_splits_is_a_routing_option_with_auto_the_default(monkeypatch):
    for cls in (FlashInferAttentionBackend, TritonMLABackend):
        cap = cls.capability
        assert cap.option_choices()["kv_splits"] == ("auto", "fixed")
        assert cap.resolve_options({})["kv_splits"] == "auto"  # routing.json of an older compile: the default
        assert cls._kernel_options({"kv_splits": "fixed"}) == {"kv_splits": "fixed"}
    # TritonTritonOnlyMLA.build passes routing's choice on
    monkeypatch.setattr(triton_mla_backend, "full_layer_options",
                        lambda setup: {"q_heads": HQ, "scales": {0: MLA_SCALE}, "mla_rope_dim": P_MLA})
    setup = types.SimpleNamespace(kv_pool=_pool("mla"), options={"kv_splits": "fixed"})
    assert TritonOnlyMLA.build(setup).fixed_splits and not TritonOnlyMLA.build(
        types.SimpleNamespace(kv_pool=setup.kv_pool, options={"kv_splits": "auto"})).fixed_splits


def test_fixed_kv_splits_refuse_layers_on_flashinfer_kernels():
    gqa, mla = _pool("gqa"), _pool("mla")
    with pytest.raises(ValueError, match=r"layer 0 \(kv_splits='fixed'\): FlashInfer's decode kernel .*"
                                         r"set decode_impl='triton'"):
        TritonOnlyFlashInfer(gqa, q_heads=HQ, decode_impl="flashinfer", kv_splits="fixed", workspace_bytes=0)
    with pytest.raises(ValueError, match=r"layer 0 \(kv_splits='fixed'\): FlashInfer's MLA kernel .*"
                                         r"set mla_impl='triton'"):
        TritonOnlyFlashInfer(mla, q_heads=HQ, scales={0: MLA_SCALE}, mla_rope_dim=P_MLA, kv_splits="fixed",
                             workspace_bytes=0)
    with pytest.raises(ValueError, match="kv_splits must be one of 'auto', 'fixed'"):
        TritonOnlyFlashInfer(gqa, q_heads=HQ, kv_splits="sometimes", workspace_bytes=0)
    assert TritonOnlyFlashInfer(gqa, q_heads=HQ, decode_impl="triton", kv_splits="fixed",
                                workspace_bytes=0).fixed_splits
    assert TritonOnlyMLA(mla, q_heads=HQ, scales={0: MLA_SCALE}, mla_rope_dim=P_MLA, kv_splits="fixed").fixed_splits


@pytest.fixture
def kernel_calls(monkeypatch):
    """The fixed_splits argument of every Triton attention call the backends make; chunks of 64
    keys (the GQA kernel's key tile at head dim 16) so the cached contexts cross a few."""
    monkeypatch.setattr(triton_split_kv, "SPLIT_TOKENS", 64)
    calls = []
    for module, name in ((triton_gqa, "triton_gqa_attention"), (triton_mla, "triton_mla_attention"),
                         (triton_mla, "triton_mla_attention_paged")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("fixed_splits")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _through(be, op, items, rows: tuple, mode: Optional[Mode] = None) -> torch.Tensor:
    """One eager step of `items` through the backend's op; rows: the op's per-row inputs."""
    ctx = build_step(items, be.kv_pool, device=DEVICE, mode=mode).ctx
    be.init_step_metadata(ctx)
    out = torch.full((rows[0].shape[0], HQ, R_MLA if op == "mla" else 16), float("nan"), device=DEVICE)
    if op == "mla":
        be.mla_attention(ctx, *rows, out, 0, MLA_SCALE)
    else:
        be.gqa_attention(ctx, *rows, out, 0, 0.25)
    return out


@in_process
@pytest.mark.parametrize("op", ["gqa", "mla"])
def test_backends_pass_fixed_splits_to_the_kernels(kernel_calls, op):
    """A (150 tokens cached) takes its next row alone, between two other requests, as the first of
    a verify step's 4 rows and (MLA) the first of an extend step's: the same bits each time, the
    row and K/V inputs the same, and every kernel call with fixed_splits=True."""
    gen = torch.Generator().manual_seed(5)
    pool = _pool(op)
    if op == "gqa":
        be = TritonOnlyFlashInfer(pool, q_heads=HQ, decode_impl="triton", kv_splits="fixed", workspace_bytes=0)
        shapes = [(HQ, 16), (1, 16), (1, 16)]
    else:
        be = TritonOnlyMLA(pool, q_heads=HQ, scales={0: MLA_SCALE}, mla_rope_dim=P_MLA, kv_splits="fixed")
        shapes = [(HQ, R_MLA), (HQ, P_MLA), (R_MLA,), (P_MLA,)]

    def rows(n):
        return tuple(torch.randn(n, *s, generator=gen).to(DEVICE) for s in shapes)

    a, x, y = SeqState(1, num_cached=150), SeqState(2, num_cached=37), SeqState(3, num_cached=90)
    mine = rows(N_VERIFY)  # A's next 4 rows
    first = tuple(t[:1] for t in mine)
    alone = _through(be, op, [(a, [0])], first)[0]
    three = _through(be, op, [(x, [0]), (a, [0]), (y, [0])],
                     tuple(torch.cat(parts) for parts in zip(rows(1), first, rows(1))))[1]
    verify = _through(be, op, [(a, [0] * N_VERIFY)], mine, mode=Mode.TARGET_VERIFY)[0]
    assert torch.equal(alone, three) and torch.equal(alone, verify)
    expected = ["triton_gqa_attention"] * 3 if op == "gqa" else ["triton_mla_attention_paged"] * 3
    if op == "mla":
        extend = _through(be, op, [(x, [0] * 2), (a, [0] * N_VERIFY)],
                          tuple(torch.cat(parts) for parts in zip(rows(2), mine)))[2]
        assert torch.equal(alone, extend)
        expected.append("triton_mla_attention")
    assert kernel_calls == [(name, True) for name in expected]


def test_the_combine_gives_a_head_the_same_bits_whatever_heads_a_program_merges():
    """_combine_kernel over several heads a program (combine_chunk_probe.py --launches weighs them)
    runs each head's code as one head a program does: the merged rows are equal bit for bit to
    combine_splits', empty splits among them."""
    from runtime.backends.kernels.split_kv import _combine_kernel, combine_chunk, combine_warps

    g = torch.Generator().manual_seed(5)
    rows, heads, splits, R = 3, 8, 6, 32
    part_o = torch.randn(rows * heads * splits, R, generator=g).to(DEVICE)
    part_lse = torch.randn(rows * heads * splits, generator=g) * 4
    part_lse[::5] = float("-inf")
    part_lse = part_lse.to(DEVICE)
    want = torch.full((rows, heads, R), float("nan"), device=DEVICE)
    combine_splits(part_o, part_lse, want, splits)
    assert torch.isfinite(want).all()
    for per in (2, 8):
        out = torch.full_like(want, float("nan"))
        _combine_kernel[(rows, heads // per)](part_o, part_lse, out, out.stride(0), out.stride(1), heads, splits,
                                              R=R, MAX_SPLITS=MAX_SPLITS, CHUNK=combine_chunk(splits), HEADS=per,
                                              USE_GDC=False, num_warps=combine_warps(splits, R))
        assert torch.equal(out, want), per


def test_the_combine_runs_a_warp_a_program_up_to_the_largest_tile_measured():
    """combine_warps: one warp for bench qwen3_next's GQA rows (head dim 256, chunks of 4 and the one
    tile of 32 splits), a warp per 32 x 256 floats past that (an MLA latent of 512 in one tile)."""
    from runtime.backends.kernels.split_kv import combine_warps

    assert [combine_warps(n, 256) for n in (1, 2, 16, 32)] == [1, 1, 1, 1]
    assert [combine_warps(n, 512) for n in (2, 32)] == [1, 2]
