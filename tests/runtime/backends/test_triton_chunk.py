"""The chunked linear-attention kernels (runtime/backends/kernels/chunk.py) against the reference recurrence.

First the math alone: a plain-torch float64 version of the kernels' algorithm (chunks, the WY
form, the block inverse over 16-row blocks) against cpu_reference.gated_recurrence,
including a chunk of identical keys where the nilpotent-product inverse would lose every digit.
Then the kernels, in Triton's interpreter on a machine without CUDA (on the GPU machine, compiled),
over one launch of several requests: lengths 0, 1, a partial chunk, an exact chunk and several
chunks; grouped value heads; the delta rule (GDN) and none (Lightning, constant decay); non-zero
initial states; slots out of row order. Outputs are compared per request by ||x - ref|| / ||ref||,
states likewise; the padding slot, free slots and the rows past the last request must come out
bit for bit as they went in. Between the kernels: the workspaces hold the recurrence's state
entering each chunk and V', and a repeated step launches with the same arguments (the Launcher's
cache key: stable workspace addresses). Shapes stay small (Dk, Dv 16 or 32, chunks of 16 or 32
rows) so the interpreter is quick; tests/gpu/test_gpu_linear_kernels.py runs the same checks at real
sizes.

The interpreter must be switched on before triton is first imported (testkit/triton_interpreter.py,
which also runs the file in a fresh process where triton was imported compiled first).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402,F401

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels import chunk as TC  # noqa: E402
from runtime.backends.kernels.launch_math import token_blocks  # noqa: E402
from runtime.backends.kernels.launch_cache import Launcher  # noqa: E402
from runtime.backends.cpu_reference import gated_recurrence  # noqa: E402
from runtime.backends.kernels.linear import GATE_CONSTANT, GATE_PER_CHANNEL, GATE_PER_HEAD  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT  # noqa: E402
from testkit.linear_cases import captured_chunk_tables  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# -- the math, in plain torch ---------------------------------------------------------------------


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for strictly lower-triangular a, row by row (the kernel's forward substitution)."""
    n = a.shape[0]
    inv = torch.eye(n, dtype=a.dtype)
    for i in range(1, n):
        inv[i] = inv[i] - a[i] @ inv
    return inv


def torch_chunked(q, k, v, g, beta, state, scale, block_t, sub=TC.SUB_T):
    """The kernels' algorithm for one request in float64: q, k [L, H, Dk]; v [L, H, Dv]; g [L, H];
    beta [L, H] or None; state [H, Dk, Dv], updated in place. Returns the outputs [L, H, Dv]."""
    q, k, v, g = q.double(), k.double(), v.double(), g.double()
    L, H, _ = q.shape
    out = torch.zeros(L, H, v.shape[2], dtype=torch.float64)
    S = state.double()
    for start in range(0, L, block_t):
        end = min(start + block_t, L)
        for h in range(H):
            Q, K, V = q[start:end, h], k[start:end, h], v[start:end, h]
            G = g[start:end, h].cumsum(0)
            decay = torch.exp(G[:, None] - G[None, :]).tril()  # exp(G_i - G_j), j <= i
            if beta is None:
                v_new = V
            else:
                b = beta[start:end, h].double()
                A = (b[:, None] * (K @ K.T) * decay).tril(-1)
                rhs = torch.cat([b[:, None] * K * torch.exp(G)[:, None], b[:, None] * V], 1)
                T = torch.zeros_like(A)  # (I + A)^-1 by blocks: T_ij = -T_ii sum_{j<=c<i} A_ic T_cj
                blocks = [slice(b, min(b + sub, end - start)) for b in range(0, end - start, sub)]
                for i, bi in enumerate(blocks):
                    T[bi, bi] = unit_lower_inverse(A[bi, bi])
                    for bj in blocks[:i]:
                        T[bi, bj] = -T[bi, bi] @ sum(A[bi, bc] @ T[bc, bj] for bc in blocks[blocks.index(bj):i])
                X = T @ rhs
                W, U = X[:, :K.shape[1]], X[:, K.shape[1]:]
                v_new = U - W @ S[h]
            out[start:end, h] = scale * ((Q * torch.exp(G)[:, None]) @ S[h] + ((Q @ K.T) * decay) @ v_new)
            S[h] = torch.exp(G[-1]) * S[h] + (K * torch.exp(G[-1] - G)[:, None]).T @ v_new
    state.copy_(S)
    return out


def unit_rows(*shape, g):
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("block_t", [16, 64])
def test_blocked_chunk_math_matches_the_recurrence(delta, block_t):
    g = torch.Generator().manual_seed(1)
    L, H, D = 150, 2, 16
    q, k, v = unit_rows(L, H, D, g=g), unit_rows(L, H, D, g=g), torch.randn(L, H, D, generator=g)
    gate = -F.softplus(torch.randn(L, H, generator=g))
    beta = torch.sigmoid(torch.randn(L, H, generator=g)) if delta else None
    s0 = torch.randn(H, D, D, generator=g)
    s_ref, s_got = s0.clone(), s0.double()
    want = gated_recurrence(q, k, v, gate[..., None], beta, s_ref, 0.25)
    got = torch_chunked(q, k, v, gate, beta, s_got, 0.25, block_t)
    assert rel_err(got, want) < 1e-5 and rel_err(s_got, s_ref) < 1e-5


def test_identical_keys_need_a_stable_inverse():
    """A chunk of one repeated key with beta = 1 and no decay: (I + A)^-1 is bidiagonal (1, -1),
    while the powers of A reach C(63, 31) ~ 1e18. Forward substitution keeps it exact; the
    nilpotent product (I - A)(I + A^2)...(I + A^32) loses every digit in float32."""
    n = 64
    A = torch.ones(n, n, dtype=torch.float64).tril(-1)
    want = torch.eye(n, dtype=torch.float64) - torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)
    assert torch.equal(unit_lower_inverse(A), want)
    a32 = A.float()
    product, power = torch.eye(n) - a32, a32 @ a32
    for _ in range(5):
        product, power = product @ (torch.eye(n) + power), power @ power
    assert rel_err(product, want) > 1e-2  # the unstable alternative, for the record


# -- the kernels ---------------------------------------------------------------------------------

NUM_SLOTS = 8


def make_case(lens, hk, hv, dk, dv, delta, gate_kind, dtype, seed, extra_rows=3, k_scale=1.0):
    """Inputs of one launch: requests of `lens` rows one after another, then `extra_rows` rows past
    bounds[R] holding NaN (never read), slots out of row order, a pool of random non-zero states."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens) + extra_rows
    x = {"q": unit_rows(T, hk, dk, g=g), "k": unit_rows(T, hk, dk, g=g) * k_scale,
         "v": torch.randn(T, hv, dv, generator=g)}
    if gate_kind == GATE_CONSTANT:
        x["gate"] = -torch.linspace(0.05, 1.0, hv)
    else:
        x["gate"] = -F.softplus(torch.randn(T, hv, generator=g))
    x["beta"] = torch.sigmoid(torch.randn(T, hv, generator=g)) if delta else None
    for name, t in x.items():
        if t is not None and t.shape[0] == T:
            t[sum(lens):] = float("nan")
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    state = torch.randn(NUM_SLOTS + 1, hv, dk, dv, generator=g) * 0.5
    perm = (torch.randperm(NUM_SLOTS, generator=g) + 1)[:len(lens)]
    return x, state, perm.tolist()


def reference(x, lens, state, slots, scale, gate_kind):
    """gated_recurrence per request on a copy of the pool: (outputs [rows, Hv, Dv] float32, pool)."""
    state = state.clone()
    hv = x["v"].shape[1]
    group = hv // x["q"].shape[1]
    out = torch.zeros(sum(lens), hv, x["v"].shape[2])
    at = 0
    for n, slot in zip(lens, slots):
        rows = slice(at, at + n)
        q, k = (x[name][rows].float().repeat_interleave(group, dim=1) for name in ("q", "k"))
        gate = x["gate"].expand(n, hv) if gate_kind == GATE_CONSTANT else x["gate"][rows]
        beta = None if x["beta"] is None else x["beta"][rows]
        s = state[slot]
        out[rows] = gated_recurrence(q, k, x["v"][rows].float(), gate[..., None], beta, s, scale)
        at += n
    return out, state


def run_kernels(x, lens, state, slots, scale, gate_kind, block_t, out_dtype, config=None):
    """chunk_extend on the device; returns (out, pool) on the host. out starts as a sentinel."""
    T = x["q"].shape[0]
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    out = torch.full((T, *x["v"].shape[1:]), 7.0, dtype=out_dtype, device=DEVICE)
    pool = state.to(DEVICE)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    chunks = torch.from_numpy(token_blocks(np.asarray(lens, dtype=np.int64), block_t)).to(DEVICE)
    TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool,
                    torch.tensor(slots, dtype=torch.int64, device=DEVICE), torch.from_numpy(cu).to(DEVICE), chunks,
                    scale, gate_kind, block_t=block_t, config=config)
    return out.cpu(), pool.cpu()


def check_requests(got, want, got_pool, want_pool, lens, slots, tol: float, state_tol: float) -> None:
    """Each request's output rows and its slot's state against the reference's."""
    at = 0
    for n, slot in zip(lens, slots):
        if n:
            err = rel_err(got[at:at + n].float(), want[at:at + n])
            assert err < tol, f"request of {n} rows: out rel err {err:.2e}"
        s_err = rel_err(got_pool[slot], want_pool[slot])
        assert s_err < state_tol, f"request of {n} rows: state rel err {s_err:.2e}"
        at += n


def check_case(lens, hk, hv, dk, dv, delta, gate_kind, dtype, block_t, seed, tol, config=None, k_scale=1.0):
    x, state, slots = make_case(lens, hk, hv, dk, dv, delta, gate_kind, dtype, seed, k_scale=k_scale)
    scale = dk ** -0.5
    want, want_pool = reference(x, lens, state, slots, scale, gate_kind)
    got, got_pool = run_kernels(x, lens, state, slots, scale, gate_kind, block_t, dtype, config)
    R = sum(lens)
    assert torch.isfinite(got).all(), "an output row was written from a masked (NaN) row"
    assert got[R:].eq(7.0).all(), "rows past bounds[R] must not be touched"
    check_requests(got, want, got_pool, want_pool, lens, slots, tol, 1e-4 if dtype == torch.float32 else tol)
    zero_len = [slot for n, slot in zip(lens, slots) if n == 0]
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots] + zero_len
    assert PADDING_SLOT in untouched
    assert torch.equal(got_pool[untouched], state[untouched]), "the padding slot, a free slot or an idle request's"


LENS = [0, 1, 13, 40, 32]  # none, one row, a partial chunk, several chunks with a tail, whole chunks


@in_process
@pytest.mark.parametrize("delta,gate_kind", [(True, GATE_PER_HEAD), (False, GATE_CONSTANT), (False, GATE_PER_HEAD)],
                         ids=["gdn", "lightning", "gla"])
def test_chunk_extend_matches_the_recurrence(delta, gate_kind):
    """Grouped value heads (Hv = 2 Hk), chunks of 16 rows, Dk = Dv = 16, float32."""
    check_case(LENS, 2, 4, 16, 16, delta, gate_kind, torch.float32, 16, seed=3, tol=1e-4,
               k_scale=1.0 if delta else 0.3)


SOLVES = pytest.mark.parametrize("in_registers", [True, False], ids=["registers", "scratch"])


@in_process
@SOLVES
@pytest.mark.parametrize("block_t", [32, 64])
def test_chunks_of_several_sub_blocks(block_t, in_registers):
    """Chunks of 32 and 64 rows (two and four 16-row diagonal blocks inverted side by side, then the
    blocks below the diagonal: in registers, where 64 rows take a squaring of N, and through the
    matrix workspace), Dk = Dv = 32 split into two Dv tiles of 16 in the state and the output
    kernels, and the output kernel's keys in two blocks of 16; one key head per value head."""
    check_case(LENS + [150], 2, 2, 32, 32, True, GATE_PER_HEAD, torch.float32, block_t, seed=4, tol=1e-4,
               config=TC.ChunkConfig(16, 1, 1, 16, 1, out_key_block=16, solve_in_registers=in_registers))


@in_process
def test_requests_past_the_first_block_find_their_first_chunk(monkeypatch):
    """The state kernel sums the chunks of the requests before its own, _REQUEST_BLOCK requests at a
    time (128); in blocks of 2 the later requests of LENS take several blocks, the last a partial one."""
    monkeypatch.setattr(TC, "_REQUEST_BLOCK", 2)
    check_case(LENS, 1, 1, 16, 16, True, GATE_PER_HEAD, torch.float32, 16, seed=12, tol=1e-4)


@in_process
def test_dims_that_are_not_powers_of_two():
    check_case([5, 20], 1, 2, 12, 20, True, GATE_PER_HEAD, torch.float32, 16, seed=5, tol=1e-4)


@in_process
@pytest.mark.parametrize("delta,gate_kind", [(True, GATE_PER_HEAD), (False, GATE_CONSTANT)], ids=["gdn", "lightning"])
def test_bf16_inputs(delta, gate_kind):
    check_case([3, 20], 2, 4, 16, 16, delta, gate_kind, torch.bfloat16, 16, seed=6, tol=1e-2,
               k_scale=1.0 if delta else 0.3)


LENS_64 = [0, 1, 63, 64, 65, 300]  # around one chunk of 64 rows, and several


@in_process
@pytest.mark.parametrize("delta,gate_kind", [(True, GATE_PER_HEAD), (False, GATE_CONSTANT)], ids=["gdn", "lightning"])
def test_bf16_inputs_keep_16_bit_workspaces_within_the_bound(delta, gate_kind):
    """16-bit inputs, chunks of 64 rows, through caller-owned workspaces: W, U (V') and the chunk
    states are bfloat16, and outputs and final states stay within the 1e-2
    bound of the float32 recurrence from random states."""
    hk, hv, dk, dv = 1, 2, 16, 16
    x, state, slots = make_case(LENS_64, hk, hv, dk, dv, delta, gate_kind, torch.bfloat16, seed=13,
                                k_scale=1.0 if delta else 0.3)
    chunks = token_blocks(np.asarray(LENS_64, dtype=np.int64), TC.CHUNK_T)
    work = TC.ChunkWorkspaces.allocate(x["q"].shape[0], chunks.shape[0], hv, dk, dv, torch.bfloat16, delta, DEVICE)
    assert work.cs.dtype == torch.bfloat16
    if delta:
        assert work.w.dtype == work.u.dtype == torch.bfloat16
    else:
        assert work.w is None and work.u is None
    scale = dk ** -0.5
    want, want_pool = reference(x, LENS_64, state, slots, scale, gate_kind)
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    out = torch.full((x["q"].shape[0], hv, dv), 7.0, dtype=torch.bfloat16, device=DEVICE)
    pool = state.to(DEVICE)
    cu = np.concatenate([[0], np.cumsum(LENS_64)]).astype(np.int64)
    TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool,
                    torch.tensor(slots, dtype=torch.int64, device=DEVICE), torch.from_numpy(cu).to(DEVICE),
                    torch.from_numpy(chunks).to(DEVICE), scale, gate_kind, workspaces=work)
    got, got_pool = out.cpu().float(), pool.cpu()
    at = 0
    for n, slot in zip(LENS_64, slots):
        if n:
            err = rel_err(got[at:at + n], want[at:at + n])
            assert err < 1e-2, f"request of {n} rows: out rel err {err:.2e}"
        s_err = rel_err(got_pool[slot], want_pool[slot])
        assert s_err < 1e-2, f"request of {n} rows: state rel err {s_err:.2e}"
        at += n
    assert got[at:].eq(7.0).all(), "rows past bounds[R] must not be touched"
    mismatched = TC.ChunkWorkspaces.allocate(  # float32 workspaces for bf16 inputs: refused
        x["q"].shape[0], chunks.shape[0], hv, dk, dv, torch.float32, delta, DEVICE)
    tables = (torch.tensor(slots, dtype=torch.int64, device=DEVICE), torch.from_numpy(cu).to(DEVICE),
              torch.from_numpy(chunks).to(DEVICE))
    with pytest.raises(ValueError, match="in torch.float32; this step needs"):
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, scale, gate_kind,
                        workspaces=mismatched)
    if delta:  # the solve through the shared matrix workspace is never handed a captured step's
        scratch = dataclasses.replace(TC.chunk_config(1, hv, dv, torch.device(DEVICE)), solve_in_registers=False)
        with pytest.raises(ValueError, match="takes no caller's workspaces"):
            TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, scale,
                            gate_kind, config=scratch, workspaces=work)


@in_process
@SOLVES
@pytest.mark.parametrize("block_t", [32, 64])
def test_repeated_keys_stay_accurate(block_t, in_registers):
    """Every row of a request has the same key, beta near 1, almost no decay: the chunk's A is close
    to the all-ones lower triangle, where an unstable inverse would blow up."""
    lens = [150]
    x, state, slots = make_case(lens, 1, 1, 16, 16, True, GATE_PER_HEAD, torch.float32, seed=7, extra_rows=0)
    x["k"][:] = x["k"][0]
    x["beta"][:] = 0.999
    x["gate"][:] = -1e-3
    want, want_pool = reference(x, lens, state, slots, 0.25, GATE_PER_HEAD)
    got, got_pool = run_kernels(x, lens, state, slots, 0.25, GATE_PER_HEAD, block_t, torch.float32,
                                dataclasses.replace(TC.chunk_config(1, 1, 16, torch.device(DEVICE)),
                                                    solve_in_registers=in_registers))
    assert rel_err(got, want) < 1e-4 and rel_err(got_pool, want_pool) < 1e-4


@in_process
def test_per_channel_gates_are_refused_naming_the_op():
    x, state, slots = make_case([4], 1, 1, 16, 16, True, GATE_PER_HEAD, torch.float32, seed=8)
    gate = torch.zeros(7, 1, 16)
    with pytest.raises(ValueError, match=r"kda_core: .*per-channel gates \(KDA\)"):
        TC.chunk_extend(x["q"], x["k"], x["v"], gate, x["beta"], torch.empty(7, 1, 16), state,
                        torch.tensor(slots), torch.tensor([0, 4]), torch.zeros(1, 2, dtype=torch.int64), 1.0,
                        GATE_PER_CHANNEL)


def states_entering_chunks(x, lens, state, slots, gate_kind, block_t):
    """The recurrence (gated_recurrence) row by row per request: the state entering each chunk, in
    the chunk table's order [N, Hv, Dk, Dv], and with the delta rule each row's corrected value
    beta_t (v_t - k_t^T exp(g_t) S_t-1) [rows, Hv, Dv] (V', the state kernel's), else None."""
    hv = x["v"].shape[1]
    group = hv // x["q"].shape[1]
    states, deltas, at = [], [], 0
    for n, slot in zip(lens, slots):
        rows = slice(at, at + n)
        q, k = (x[name][rows].float().repeat_interleave(group, dim=1) for name in ("q", "k"))
        v = x["v"][rows].float()
        gate = x["gate"].expand(n, hv) if gate_kind == GATE_CONSTANT else x["gate"][rows]
        beta = None if x["beta"] is None else x["beta"][rows]
        s = state[slot].clone()
        for t in range(n):
            if t % block_t == 0:
                states.append(s.clone())
            if beta is not None:
                decayed = s * torch.exp(gate[t])[:, None, None]
                deltas.append(beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], decayed)))
            gated_recurrence(q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1, :, None],
                             None if beta is None else beta[t:t + 1], s, 1.0)
        at += n
    return torch.stack(states), (torch.stack(deltas) if deltas else None)


@in_process
@pytest.mark.parametrize("delta,gate_kind,dtype", [(True, GATE_PER_HEAD, torch.float32),
                                                   (False, GATE_CONSTANT, torch.float32),
                                                   (True, GATE_PER_HEAD, torch.bfloat16)],
                         ids=["gdn-f32", "lightning-f32", "gdn-bf16"])
def test_the_workspaces_hold_the_states_entering_each_chunk_and_v_prime(delta, gate_kind, dtype):
    """What the state kernel leaves the output kernel: row c of the chunk-state workspace is the
    recurrence's state entering chunk c of the table, and with the delta rule U's storage holds V',
    each row's corrected value (both float32 for float32 inputs, bfloat16 for 16-bit ones)."""
    block_t, hv, dk, dv = 16, 4, 16, 16
    x, state, slots = make_case(LENS, 2, hv, dk, dv, delta, gate_kind, dtype, seed=9, k_scale=1.0 if delta else 0.3)
    want_states, want_v_prime = states_entering_chunks(x, LENS, state, slots, gate_kind, block_t)
    run_kernels(x, LENS, state.clone(), slots, dk ** -0.5, gate_kind, block_t, dtype)
    device = torch.empty(0, device=DEVICE).device
    chunks = token_blocks(np.asarray(LENS, dtype=np.int64), block_t)
    assert want_states.shape[0] == chunks.shape[0]
    work_dtype = TC.chunk_workspace_dtype(dtype)
    assert work_dtype == (torch.float32 if dtype == torch.float32 else torch.bfloat16)
    states = TC.chunk_state_workspace(chunks.shape[0], hv, dk, dv, work_dtype, device).cpu()
    # bf16 workspaces: a rounding of 2**-8 at most (the interpreter truncates: 2**-7)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for c, (req, start) in enumerate(chunks.tolist()):
        err = rel_err(states[c].float(), want_states[c])
        assert err < tol, f"chunk {c} (request {req}, row {start}): state rel err {err:.2e}"
    if delta:
        _, v_prime = TC.chunk_workspace(sum(LENS), hv, dk, dv, work_dtype, device)
        assert v_prime.dtype == work_dtype
        err = rel_err(v_prime.cpu().float(), want_v_prime)
        assert err < tol, f"V' rel err {err:.2e}"


@in_process
@pytest.mark.parametrize("delta,gate_kind", [(True, GATE_PER_HEAD), (False, GATE_CONSTANT)], ids=["gdn", "lightning"])
def test_a_repeated_step_launches_with_the_same_arguments(monkeypatch, delta, gate_kind):
    """The same step twice on the same buffers: each launch gets the argument list it got the first
    time (the Launcher's cache key: the workspaces kept their addresses), so on the GPU every launch
    after the first takes the Launcher's compiled kernel. Three launches with the delta rule (solve,
    state, output), two without."""
    launchers = {"solve": TC._CHUNK_SOLVE, "state": TC._CHUNK_STATE, "output": TC._CHUNK_OUTPUT}
    keys = []
    for name, launcher in launchers.items():
        def recording(grid, args, kwargs, name=name, launch=launcher.launch):
            keys.append((name, Launcher._key(grid, args, kwargs)))
            launch(grid, args, kwargs)
        monkeypatch.setattr(launcher, "launch", recording)
    lens = [13, 20]
    x, state, slots = make_case(lens, 1, 2, 16, 16, delta, gate_kind, torch.float32, seed=10, extra_rows=0)
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    out, pool = torch.empty(sum(lens), 2, 16, device=DEVICE), state.to(DEVICE)
    tables = (torch.tensor(slots, device=DEVICE), torch.tensor([0, 13, 33], device=DEVICE),
              torch.from_numpy(token_blocks(np.asarray(lens, dtype=np.int64), 16)).to(DEVICE))
    for _ in range(2):
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, 0.25, gate_kind,
                        block_t=16)
    first, second = keys[:len(keys) // 2], keys[len(keys) // 2:]
    assert [name for name, _ in first] == (["solve", "state", "output"] if delta else ["state", "output"])
    assert first == second


BUCKET, BUCKET_SEQS = 64, 2  # rows and requests of the captured-style steps below (chunks of 16)


@in_process
@pytest.mark.parametrize("lens", [[], [1], [16], [10, 7], [40, 24]],
                         ids=["none", "one", "a_chunk", "a_chunk_and_one", "the_bucket"])
@pytest.mark.parametrize("delta,gate_kind,dtype", [(True, GATE_PER_HEAD, torch.float32),
                                                   (False, GATE_CONSTANT, torch.float32),
                                                   (True, GATE_PER_HEAD, torch.bfloat16)],
                         ids=["gdn", "lightning", "gdn_bf16"])
def test_a_captured_step_writes_zeros_over_its_padding_rows(lens, delta, gate_kind, dtype):
    """A captured-style step (tables padded to a bucket of 64 rows and 2 requests, the padding rows
    the last request of the bounds and the chunk table) over an output full of NaN: real rows as
    the recurrence's, every padding row exactly zero, whatever the real count (0, 1, a chunk, a
    chunk and one, the whole bucket); the states as the recurrence leaves them, the padding slot
    untouched. Inputs past the real rows are NaN, so a padding row computed from them would show."""
    x, state, slots = make_case(lens, 2, 4, 16, 16, delta, gate_kind, dtype, seed=13, extra_rows=BUCKET - sum(lens),
                                k_scale=1.0 if delta else 0.3)
    scale = 16 ** -0.5
    want, want_pool = reference(x, lens, state, slots, scale, gate_kind)
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    out = torch.full((BUCKET, 4, 16), float("nan"), dtype=dtype, device=DEVICE)
    pool = state.to(DEVICE)
    tables = captured_chunk_tables(lens, slots, BUCKET, BUCKET_SEQS, 16, DEVICE)
    workspaces = TC.ChunkWorkspaces.allocate(BUCKET, tables[2].shape[0], 4, 16, 16, dtype, delta, DEVICE)
    TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, scale, gate_kind,
                    block_t=16, workspaces=workspaces)
    got, got_pool = out.cpu(), pool.cpu()
    real = sum(lens)
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows must come out exactly zero"
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    if real:
        assert rel_err(got[:real].float(), want) < tol
        assert rel_err(got_pool[slots], want_pool[slots]) < tol
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    assert torch.equal(got_pool[untouched], state[untouched]), "the padding slot or a free slot was written"


def test_a_kernel_walks_a_padded_table_only_where_it_is_many_times_its_walking_rows():
    """`_table_programs` at bench qwen3_next's launches over a 256-request bucket (132 SMs): the state
    kernel (257 requests, 128 programs a request) walks at 512 and 4096 tokens; the solve and output
    kernels (their tables 264 and 320 chunk rows) walk at 512 tokens (9 rows kept) and not at 4096
    (65 kept: 320 is under WALK_TABLE_RATIO times that); an eager table never walks."""
    dev = torch.device("cpu")
    assert TC._table_programs(257, 1, 32 * 4, True, dev) == (3, True)
    assert TC._table_programs(264, 512 // 64 + 1, 32, True, dev) == (9, True)
    assert TC._table_programs(264, 512 // 64 + 1, 64, True, dev) == (9, True)
    assert TC._table_programs(320, 4096 // 64 + 1, 32, True, dev) == (320, False)
    assert TC._table_programs(257, 1, 128, False, dev) == (257, False)


WIDE_SEQS = 12  # request rows of the walking steps below: more than their requests and one request's programs


@in_process
@pytest.mark.parametrize("lens", [[], [1], [10, 0, 7, 20]], ids=["none", "one", "three_and_an_empty_one"])
@pytest.mark.parametrize("delta,gate_kind", [(True, GATE_PER_HEAD), (False, GATE_CONSTANT)], ids=["gdn", "lightning"])
def test_a_padded_table_walked_by_fewer_programs_gives_the_same_bits(monkeypatch, lens, delta, gate_kind):
    """A captured-style step over a table of 12 request rows (a 64-row bucket, chunks of 16), with
    in-step snapshots of two requests: with no floor on the programs an SM (TABLE_PROGRAMS_PER_SM
    0) and a walk wherever the table is longer (WALK_TABLE_RATIO 1) each kernel keeps one request's
    rows of programs (the state kernel one request, the solve and output kernels a bucket's chunks
    and the padding's) and walks the table (WALK), and its
    outputs, states and snapshots are the same bits as a program a row's; both as the recurrence's."""
    x, state, slots = make_case(lens, 2, 4, 16, 16, delta, gate_kind, torch.float32, seed=17,
                                extra_rows=BUCKET - sum(lens), k_scale=1.0 if delta else 0.3)
    scale = 16 ** -0.5
    want, want_pool = reference(x, lens, state, slots, scale, gate_kind)
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    tables = captured_chunk_tables(lens, slots, BUCKET, WIDE_SEQS, 16, DEVICE)
    snap_at = [5, -1, -1, 16][:len(lens)] + [-1] * (WIDE_SEQS + 1 - len(lens))
    grids = []
    for kernel in (TC._CHUNK_SOLVE, TC._CHUNK_STATE, TC._CHUNK_OUTPUT):
        monkeypatch.setattr(kernel, "launch", lambda grid, args, kwargs, launch=kernel.launch: (
            grids.append((grid[0], kwargs["WALK"])), launch(grid, args, kwargs)))
    results = []
    monkeypatch.setattr(TC, "WALK_TABLE_RATIO", 1)  # every table longer than the walking rows walks
    for per_sm in (0, 10 ** 6):
        monkeypatch.setattr(TC, "TABLE_PROGRAMS_PER_SM", per_sm)
        out = torch.full((BUCKET, 4, 16), float("nan"), device=DEVICE)
        pool = state.to(DEVICE, copy=True)
        snaps = TC.StepSnapshots(torch.tensor(snap_at, device=DEVICE), torch.arange(WIDE_SEQS + 1, device=DEVICE),
                                 torch.zeros(WIDE_SEQS + 1, 4, 16, 16, device=DEVICE))
        workspaces = TC.ChunkWorkspaces.allocate(BUCKET, tables[2].shape[0], 4, 16, 16, torch.float32, delta, DEVICE)
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, scale,
                        gate_kind, block_t=16, workspaces=workspaces, snapshots=snaps)
        results.append((out.cpu(), pool.cpu(), snaps.pool.cpu()))
    table_rows = tables[2].shape[0]  # 64 / 16 + 12 chunk rows; 13 requests
    walked = [(BUCKET // 16 + 1, True)] * delta + [(1, True), (BUCKET // 16 + 1, True)]
    whole = [(table_rows, False)] * delta + [(WIDE_SEQS + 1, False), (table_rows, False)]
    assert grids == walked + whole
    for walk, one_a_row in zip(*results):
        assert torch.equal(walk, one_a_row)
    got, got_pool, _ = results[0]
    assert torch.equal(got[sum(lens):], torch.zeros_like(got[sum(lens):])), "padding rows must come out exactly zero"
    check_requests(got, want, got_pool, want_pool, lens, slots, 1e-4, 1e-4)


@in_process
def test_the_padding_rows_need_their_own_request():
    """bounds [R+2] name the padding rows; any other length is refused, naming both forms."""
    x, state, slots = make_case([5], 1, 1, 16, 16, True, GATE_PER_HEAD, torch.float32, seed=14)
    dev = {n: t.to(DEVICE) for n, t in x.items()}
    out = torch.zeros(8, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match=r"bounds must be \[2\] for 1 requests, or \[3\] with the padding"):
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, state.to(DEVICE),
                        torch.tensor(slots, device=DEVICE), torch.tensor([0, 5, 8, 8], device=DEVICE),
                        torch.tensor([[0, 0]], device=DEVICE), 0.25, GATE_PER_HEAD, block_t=16)


def test_the_chunk_table_is_the_one_fla_takes_and_the_kernels_find_each_chunk_from_it():
    """(request, chunk j) rows, requests of no rows left out: the kernels start chunk j of request r at
    bounds[r] + j * block_t, so a request after an empty one and a partial last chunk land right."""
    table = token_blocks(np.array([0, 1, 33, 32, 0, 5], dtype=np.int64), 16)
    assert table.dtype == np.int64
    assert table.tolist() == [[1, 0], [2, 0], [2, 1], [2, 2], [3, 0], [3, 1], [5, 0]]
    assert token_blocks(np.zeros(0, dtype=np.int64), 64).shape == (0, 2)


def test_the_workspace_keeps_its_address_for_steps_that_fit():
    cpu = torch.device("cpu")
    w, u = TC.chunk_workspace(100, 3, 16, 8, torch.bfloat16, cpu)
    assert w.shape == (100, 3, 16) and u.shape == (100, 3, 8) and w.dtype == u.dtype == torch.bfloat16
    w2, u2 = TC.chunk_workspace(200, 3, 16, 8, torch.bfloat16, cpu)
    assert (w2.data_ptr(), u2.data_ptr()) == (w.data_ptr(), u.data_ptr())
    w3, _ = TC.chunk_workspace(300, 3, 16, 8, torch.bfloat16, cpu)
    assert w3.shape[0] == 300
    # float32 inputs keep float32 W and U, in a workspace of their own
    assert TC.chunk_workspace(100, 3, 16, 8, torch.float32, cpu)[0].dtype == torch.float32


def test_the_chunk_state_workspace_keeps_its_address_for_steps_that_fit():
    cs = TC.chunk_state_workspace(5, 3, 16, 8, torch.bfloat16, torch.device("cpu"))
    assert cs.shape == (5, 3, 16, 8) and cs.dtype == torch.bfloat16
    assert TC.chunk_state_workspace(16, 3, 16, 8, torch.bfloat16, torch.device("cpu")).data_ptr() == cs.data_ptr()
    assert TC.chunk_state_workspace(17, 3, 16, 8, torch.bfloat16, torch.device("cpu")).shape[0] == 17
    # float32 inputs keep float32 chunk states, in a workspace of their own
    assert TC.chunk_state_workspace(5, 3, 16, 8, torch.float32, torch.device("cpu")).dtype == torch.float32
    assert [TC.chunk_workspace_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [
        torch.float32, torch.bfloat16, torch.bfloat16]


# -- short steps: their own chunk length ----------------------------------------------------------


def test_a_short_step_chunks_by_its_rows_and_keeps_the_64_row_table():
    """chunk_length: 16 rows at most for 16, 32 for 17 to 32, 64 from 33 on; a length under 64 is at
    least the step's rows, so every request of the step has one chunk and the 64-row table (FLA's,
    the backend's one table and the device-built one) is the table of that length too."""
    assert [TC.chunk_length(n) for n in (1, 9, 16, 17, 32, 33, 64, 65, 4096)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    rng = np.random.default_rng(0)
    for rows in (1, 5, 16, 17, 31, 32):
        for _ in range(20):
            cuts = np.sort(rng.integers(0, rows + 1, size=rng.integers(1, 5)))
            lens = np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int64)
            assert np.array_equal(token_blocks(lens, TC.CHUNK_T), token_blocks(lens, TC.chunk_length(rows)))


SHORT_STEPS = [(16, [5, 11]), (16, [16]), (32, [1, 20, 3]), (32, [32]), (32, [])]


@in_process
@pytest.mark.parametrize("bucket,lens", SHORT_STEPS, ids=["16:5+11", "16:16", "32:1+20+3", "32:32", "32:none"])
@pytest.mark.parametrize("delta,gate_kind,dtype", [(True, GATE_PER_HEAD, torch.float32),
                                                   (False, GATE_CONSTANT, torch.float32),
                                                   (True, GATE_PER_HEAD, torch.bfloat16)],
                         ids=["gdn", "lightning", "gdn_bf16"])
def test_a_short_captured_step_runs_chunks_of_its_own_length(monkeypatch, bucket, lens, delta, gate_kind, dtype):
    """A captured-style step of a 16- or 32-row bucket and 4 request rows, over the backend's 64-row
    table (captured_chunk_tables at CHUNK_T) with no block_t: the kernels take chunks of the bucket's
    rows (chunk_length), the short tiles (chunk_config's single-chunk choice: the solve's W and U
    columns split over two programs at Dk = Dv = 64) and give the recurrence's outputs and states;
    padding rows exactly zero over an output full of NaN, the padding slot untouched."""
    seqs, hv, dk = 4, 2, 64
    block_ts = []
    launch = TC._CHUNK_OUTPUT.launch
    monkeypatch.setattr(TC._CHUNK_OUTPUT, "launch",
                        lambda grid, args, kwargs: (block_ts.append(kwargs["BT"]), launch(grid, args, kwargs)))
    x, state, slots = make_case(lens, 1, hv, dk, dk, delta, gate_kind, dtype, seed=21, extra_rows=bucket - sum(lens),
                                k_scale=1.0 if delta else 0.3)
    scale = dk ** -0.5
    want, want_pool = reference(x, lens, state, slots, scale, gate_kind)
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    out = torch.full((bucket, hv, dk), float("nan"), dtype=dtype, device=DEVICE)
    pool = state.to(DEVICE)
    tables = captured_chunk_tables(lens, slots, bucket, seqs, TC.CHUNK_T, DEVICE)
    config = TC.chunk_config(1, hv, dk, torch.device(DEVICE), True)
    assert config.solve_col_tiles == 2 and config.block_v == 32 and config.out_block_v == 32
    workspaces = TC.ChunkWorkspaces.allocate(bucket, tables[2].shape[0], hv, dk, dk, dtype, delta, DEVICE)
    TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out, pool, *tables, scale, gate_kind,
                    config=config, workspaces=workspaces)
    assert block_ts == [bucket]
    got, got_pool = out.cpu(), pool.cpu()
    real = sum(lens)
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows must come out exactly zero"
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    check_requests(got, want, got_pool, want_pool, lens, slots, tol, tol)
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    assert torch.equal(got_pool[untouched], state[untouched]), "the padding slot or a free slot was written"


@in_process
def test_an_eager_short_step_chunks_as_the_replay_of_its_bucket():
    """The same requests eagerly (bounds of the real rows only, 20 rows) and in a 32-row bucket's
    captured-style tables: both take chunks of 32 rows, so outputs and states agree to float32
    rounding (the tiles differ: one request's for the bucket, three for the eager step)."""
    lens, bucket = [1, 16, 3], 32
    x, state, slots = make_case(lens, 1, 2, 32, 32, True, GATE_PER_HEAD, torch.float32, seed=22,
                                extra_rows=bucket - sum(lens))
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    real = sum(lens)
    eager_out, eager_pool = torch.zeros(real, 2, 32, device=DEVICE), state.clone().to(DEVICE)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)).to(DEVICE)
    chunks = torch.from_numpy(token_blocks(np.asarray(lens, dtype=np.int64), TC.CHUNK_T)).to(DEVICE)
    TC.chunk_extend(*(dev[n][:real] for n in ("q", "k", "v", "gate", "beta")), eager_out, eager_pool,
                    torch.tensor(slots, device=DEVICE), cu, chunks, 0.25, GATE_PER_HEAD)
    graph_out, graph_pool = torch.zeros(bucket, 2, 32, device=DEVICE), state.clone().to(DEVICE)
    tables = captured_chunk_tables(lens, slots, bucket, 4, TC.CHUNK_T, DEVICE)
    TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], graph_out, graph_pool, *tables, 0.25,
                    GATE_PER_HEAD, config=TC.chunk_config(1, 2, 32, torch.device(DEVICE), True))
    assert rel_err(graph_out[:real].cpu(), eager_out.cpu()) < 1e-6
    assert rel_err(graph_pool.cpu(), eager_pool.cpu()) < 1e-6


@in_process
def test_a_split_solve_takes_no_matrix_workspace():
    """solve_col_tiles > 1 forms T in every column program: through the shared scratch (one tile a
    chunk and head) they would race, so that pairing is refused."""
    x, state, slots = make_case([5], 1, 1, 64, 64, True, GATE_PER_HEAD, torch.float32, seed=23)
    dev = {n: t.to(DEVICE) for n, t in x.items()}
    config = TC.ChunkConfig(16, 4, 4, 32, 4, solve_in_registers=False, solve_col_tiles=2)
    with pytest.raises(ValueError, match="solve_col_tiles=2"):
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], torch.zeros(8, 1, 64, device=DEVICE),
                        state.to(DEVICE), torch.tensor(slots, device=DEVICE), torch.tensor([0, 5], device=DEVICE),
                        torch.tensor([[0, 0]], device=DEVICE), 0.25, GATE_PER_HEAD, config=config)


def run_with_norm(x, lens, state, slots, scale, block_t, dtype, gated, tables=None, config=None):
    """chunk_extend with the gated norm folded in (out starts as NaN), and the unfused pair: chunk_extend
    into a core, then gdn_fused's gated_rmsnorm over its real rows. (fused out, unfused out) on the host."""
    from runtime.backends.kernels.gdn_fused import gated_rmsnorm

    T, hv, dv = x["v"].shape
    dev = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    if tables is None:
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)).to(DEVICE)
        chunks = torch.from_numpy(token_blocks(np.asarray(lens, dtype=np.int64), block_t)).to(DEVICE)
        tables = (torch.tensor(slots, dtype=torch.int64, device=DEVICE), cu, chunks)
    outs = []
    for fold in (True, False):
        pool = state.clone().to(DEVICE)  # each from the same states (on the CPU .to would not copy)
        core = torch.full((T, hv, dv), float("nan"), dtype=dtype, device=DEVICE)
        out = torch.full((T, hv, dv), float("nan"), dtype=dtype, device=DEVICE)
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], out if fold else core, pool, *tables,
                        scale, GATE_PER_HEAD, block_t=block_t, config=config, gated_norm=gated if fold else None)
        if not fold:
            bounds = torch.tensor([*np.cumsum([0, *lens]).tolist(), T], dtype=torch.int64, device=DEVICE)
            gated_rmsnorm(core, gated.z, gated.weight, out, gated.eps, bounds=bounds)
        outs.append(out.cpu())
    return outs


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_gated_norm_in_the_output_kernel_gives_the_norm_launch_s_rows(dtype):
    """GDN's core with its GatedRMSNorm folded into the output kernel (GatedNorm) against the core
    then gdn_fused's norm kernel, over requests of 0, 1, a partial chunk, several chunks: Dv 32 in
    output tiles of 16 by the config, which the fold widens to the whole row; z a strided view (as
    the mixer's projection hands it); rows past the requests never written. The same values up to
    the order of the row sums."""
    lens, hk, hv, dk, dv = LENS, 2, 4, 16, 32
    x, state, slots = make_case(lens, hk, hv, dk, dv, True, GATE_PER_HEAD, dtype, seed=31)
    g = torch.Generator().manual_seed(32)
    T = x["v"].shape[0]
    z = torch.randn(T, hv, dv + 8, generator=g).to(dtype)[..., :dv].to(DEVICE)
    weight = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype).to(DEVICE)
    gated = TC.GatedNorm(z, weight, 1e-6)
    fused, apart = run_with_norm(x, lens, state, slots, dk ** -0.5, 16, dtype, gated,
                                 config=TC.ChunkConfig(16, 1, 1, 16, 1, out_key_block=16))
    real = sum(lens)
    assert fused[real:].isnan().all(), "rows past the requests must not be touched"
    assert torch.isfinite(fused[:real]).all()
    err = rel_err(fused[:real].float(), apart[:real].float())
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), f"folded norm against the norm's launch: {err:.2e}"


@in_process
@pytest.mark.parametrize("lens", [[], [10, 7], [40, 24]], ids=["none", "a_chunk_and_one", "the_bucket"])
def test_a_captured_step_with_the_folded_norm_writes_zeros_over_its_padding_rows(lens):
    """The fold over a captured-style table (the padding rows the table's last request): the real rows
    as the unfused pair gives them, every padding row exactly zero over an output full of NaN."""
    x, state, slots = make_case(lens, 2, 4, 16, 16, True, GATE_PER_HEAD, torch.bfloat16, seed=33,
                                extra_rows=BUCKET - sum(lens))
    g = torch.Generator().manual_seed(34)
    gated = TC.GatedNorm(torch.randn(BUCKET, 4, 16, generator=g).to(torch.bfloat16).to(DEVICE),
                         torch.ones(16, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    tables = captured_chunk_tables(lens, slots, BUCKET, BUCKET_SEQS, 16, DEVICE)
    fused, apart = run_with_norm(x, lens, state, slots, 16 ** -0.5, 16, torch.bfloat16, gated, tables=tables)
    real = sum(lens)
    assert torch.equal(fused[real:], torch.zeros_like(fused[real:])), "padding rows must come out exactly zero"
    if real:
        assert rel_err(fused[:real].float(), apart[:real].float()) < 1e-2


@in_process
def test_the_folded_norm_refuses_a_z_of_another_shape():
    x, state, slots = make_case([5], 1, 1, 16, 16, True, GATE_PER_HEAD, torch.float32, seed=35)
    dev = {n: t.to(DEVICE) for n, t in x.items()}
    gated = TC.GatedNorm(torch.zeros(8, 1, 8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="gated norm"):
        TC.chunk_extend(dev["q"], dev["k"], dev["v"], dev["gate"], dev["beta"], torch.zeros(8, 1, 16, device=DEVICE),
                        state.to(DEVICE), torch.tensor(slots, device=DEVICE), torch.tensor([0, 5], device=DEVICE),
                        torch.tensor([[0, 0]], device=DEVICE), 0.25, GATE_PER_HEAD, gated_norm=gated)
