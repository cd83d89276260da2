"""In-step snapshots written by the Triton kernels (docs/DESIGN.md, "The prefix cache's snapshots").

- The chunk kernels (GDN's delta rule, Lightning's constant decay): a request's snapshot after its
  first r rows of the step equals, bit for bit in float32, the state a launch of those r rows alone
  leaves (r inside a chunk, at a chunk's first row, in the first chunk, past several chunks), and the
  reference recurrence's within float32 rounding; the step's outputs and slots do not move by a bit;
  ids not asked for stay untouched.
- The extend conv: the history after a request's first r tokens, bit for bit, r below and above K-1.
- The backend: TritonLinearBackend writes what the CPU reference writes, in eager steps and in
  replayed ones (the static plan), and answers `writes_step_snapshots` only for its own pool and
  only where no extend step of its ops reaches FLA's kernels.

Kernels run in Triton's interpreter here (testkit/triton_interpreter.py);
tests/gpu/test_gpu_step_snapshots.py runs the same checks at real dims."""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.cpu_reference import CPUReferenceBackend  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.cache.kv_pool import KVPool  # noqa: E402
from runtime.cache.snapshot_pool import SnapshotPool  # noqa: E402
from runtime.cache.state_pool import StatePool  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402
from testkit.snapshot_cases import check_chunk_snapshots, check_conv_snapshots  # noqa: E402
from tests.runtime.backends.test_cpu_step_snapshots import LAYER, REGISTRY, call, token_inputs  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)


@in_process
@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "lightning"])
def test_the_chunk_kernels_write_the_state_after_the_snapshot_row_bit_for_bit(delta):
    got = check_chunk_snapshots((2, 4, 16, 16), delta, torch.float32, DEVICE)
    assert got["outputs_same"] and got["slots_same"], got
    assert got["snapshot_vs_prefix_launch"] == 0.0, got
    assert got["snapshot_vs_reference"] <= 1e-5, got
    assert got["unasked_ids_zero"] and got["none_zero"], got


@in_process
def test_the_extend_conv_writes_the_history_after_the_snapshot_row_bit_for_bit():
    got = check_conv_snapshots(24, 4, torch.float32, DEVICE)
    assert got == {"outputs_same": True, "slots_same": True, "snapshots_exact": True, "unasked_ids_zero": True}


# (cached tokens, new tokens, snapshot row or None) per request: one past a 64-row chunk, so the
# step runs 64-row chunks and the snapshot of request 0 lands in its second one.
REQUESTS = [(4, 79, 70), (0, 1, None), (0, 6, 5), (8, 3, 1)]
PAD = 3


def run_step(op: str, backend_of, replayed: bool = False):
    """One padded step of REQUESTS on fresh pools (slot 1 + b: request b's state, random), request b
    writing snapshot b where it has a row; (outputs of the real rows, state pool, snapshot pool)."""
    g = torch.Generator().manual_seed(0)
    state_pool, kv_pool = StatePool(REGISTRY, len(REQUESTS), DEVICE), KVPool(REGISTRY, 64, 4)
    for t in state_pool.layer(LAYER).values():
        t[1:1 + len(REQUESTS)] = torch.randn(len(REQUESTS), *t.shape[1:], generator=g)
    snapshots = SnapshotPool(REGISTRY, len(REQUESTS), DEVICE)
    backend = backend_of(kv_pool, state_pool, snapshots)
    items = []
    for b, (cached, n, row) in enumerate(REQUESTS):
        seq = SeqState(1 + b, kv_pool.alloc(kv_pool.pages_for(cached)), cached)
        seq.snapshot = None if row is None else (cached + row, b)
        items.append((seq, [0] * n))
    T = sum(n for _, n, _ in REQUESTS)
    step = build_step(items, kv_pool, pad_tokens_to=T + PAD, pad_seqs_to=len(REQUESTS) + PAD)
    ctx = step.ctx
    if isinstance(backend, TritonLinearBackend):
        backend.init_step_metadata(ctx)
        backend.init_chunk_metadata(ctx, 2048)
        if replayed:
            backend.init_capture_state(T + PAD, len(REQUESTS) + PAD)
            backend.init_replay_state(ctx, ctx.num_seqs)
    x = {name: torch.cat([t, t[:PAD]]).to(DEVICE) for name, t in token_inputs(op, T, g).items()}
    out = call(op, backend, ctx, x)
    return out[:T].cpu(), state_pool, snapshots


def triton_backend(with_pool: bool):
    return lambda kv, states, snapshots: TritonLinearBackend(states, chunk_impl="triton",
                                                             snapshots=snapshots if with_pool else None)


@in_process
@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU reference's harness (test_cpu_step_snapshots.call) runs on the host")
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("op", ["short_conv", "gdn_core", "lightning_core", "gdn_fused"])
def test_the_backend_writes_what_the_cpu_reference_writes(op, replayed):
    cpu = lambda kv, states, snapshots: CPUReferenceBackend(kv, states, snapshots=snapshots)
    _, _, want = run_step(op, cpu)
    out, states, got = run_step(op, triton_backend(True), replayed)
    plain_out, plain, untouched = run_step(op, triton_backend(False), replayed)
    assert torch.equal(out, plain_out)
    entries = ("conv", "recurrent") if op == "gdn_fused" else ("conv",) if op == "short_conv" else ("recurrent",)
    for name in entries:
        assert torch.equal(states.layer(LAYER)[name].cpu(), plain.layer(LAYER)[name].cpu()), name
        snap, ref = got.buffers[LAYER][name].cpu(), want.buffers[LAYER][name]
        asked = [b for b, (*_, row) in enumerate(REQUESTS) if row is not None]
        assert rel_err(snap[asked], ref[asked]) <= 1e-5, name
        assert all(snap[b].any() for b in asked), name
        assert not snap[1].any() and not untouched.buffers[LAYER][name].any(), name  # no row, or no pool: none written


def test_the_backend_writes_step_snapshots_into_its_own_pool_where_no_step_reaches_fla():
    states = StatePool(REGISTRY, 2)
    pool, other = SnapshotPool(REGISTRY, 2), SnapshotPool(REGISTRY, 2)
    ours = TritonLinearBackend(states, chunk_impl="triton", snapshots=pool, routed_ops={"gdn_core", "short_conv"})
    assert ours.writes_step_snapshots(pool)
    assert not ours.writes_step_snapshots(other) and not ours.writes_step_snapshots(None)
    assert not TritonLinearBackend(states, chunk_impl="fla", snapshots=pool,
                                   routed_ops={"gdn_core"}).writes_step_snapshots(pool)
    # KDA's long steps run FLA's chunk kernels, which return the state after the last token alone
    assert not TritonLinearBackend(states, chunk_impl="triton", snapshots=pool,
                                   routed_ops={"kda_core", "short_conv"}).writes_step_snapshots(pool)
    assert not TritonLinearBackend(states, chunk_impl="triton", snapshots=pool).writes_step_snapshots(pool)
