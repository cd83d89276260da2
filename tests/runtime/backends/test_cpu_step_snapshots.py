"""The CPU reference's in-step snapshots, op by op.

- short_conv, gdn_core, kda_core and lightning_core write, for each request of a padded step with a
  snapshot row r, exactly the state an unpadded step of that request's first r rows alone leaves
  on a fresh slot, bit for bit in float32; the request's slot and outputs are those of that step
  followed by one of the rest.
- gdn_fused writes what the region it stands for (short_conv, glue, gdn_core) writes in the same
  step, bit for bit. (Against a step of the first r rows alone its glue differs in the last bits:
  torch's CPU exp and softplus round a tensor's tail elements otherwise than its vectorised body,
  so a row's g depends on how many rows the step has.)
- A backend answers `writes_step_snapshots` for the pool it writes into alone; a backend set
  answers yes only if every member that may run a linear-state op does."""

from __future__ import annotations

import pytest
import torch

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec
from compiler.splitops.gdn_mixer import gated_rms_norm, gdn_mixer_region
from runtime.backends.backend_set import BackendSet
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.backends.triton_linear import TritonLinearBackend
from runtime.cache.batch import SeqState, build_step
from runtime.cache.kv_pool import KVPool
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool
from runtime.step.bound_ops import BoundOps
from tests.runtime.backends.test_backend_set import Spy

HK, HV, DK, DV, K = 2, 4, 8, 8, 4
C = 2 * HK * DK + HV * DV
LAYER, SCALE = 0, DK ** -0.5
REGISTRY = LayerRegistry([LayerSpec(LAYER, LayerKind.GDN, state={"recurrent": TensorSpec((HV, DK, DV), "float32"),
                                                                 "conv": TensorSpec((C, K - 1), "float32")})])
WRITES = {"short_conv": ("conv",), "gdn_fused": ("conv", "recurrent")}  # the others: the recurrent state
OPS = ["short_conv", "gdn_core", "kda_core", "lightning_core"]
# (cached tokens, new tokens, snapshot row or None) of each request of the step
REQUESTS = [(4, 9, 4), (0, 1, None), (0, 6, 5), (8, 3, 1)]


def token_inputs(op: str, T: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    r = lambda *shape: torch.randn(T, *shape, generator=g)
    if op == "short_conv":
        return {"x": r(C)}
    if op in ("gdn_fused", "gdn_mixer_region"):
        return {"qkv": r(C), "z": r(HV, DV), "b": r(HV), "a": r(HV)}
    heads = HK if op == "gdn_core" else HV
    x = {"q": torch.nn.functional.normalize(r(heads, DK), dim=-1),
         "k": torch.nn.functional.normalize(r(heads, DK), dim=-1), "v": r(HV, DV)}
    if op != "lightning_core":
        x["g"] = -torch.nn.functional.softplus(r(HV) if op == "gdn_core" else r(HV, DK))
        x["beta"] = torch.sigmoid(r(HV))
    return x


WEIGHTS = {"conv_weight": torch.randn(C, K, generator=torch.Generator().manual_seed(1)) * 0.5,
           "A_log": torch.rand(HV, generator=torch.Generator().manual_seed(2)).log(),
           "dt_bias": torch.randn(HV, generator=torch.Generator().manual_seed(3)),
           "norm_weight": 1 + 0.1 * torch.randn(DV, generator=torch.Generator().manual_seed(4)),
           "decay": -torch.rand(HV, generator=torch.Generator().manual_seed(5))}


def call(op: str, backend, ctx, x: dict[str, torch.Tensor]) -> torch.Tensor:
    T, w = ctx.num_tokens, WEIGHTS
    out = torch.zeros(T, C) if op == "short_conv" else torch.zeros(T, HV, DV)
    if op == "short_conv":
        backend.short_conv(ctx, x["x"], w["conv_weight"], None, out, LAYER, True)
    elif op == "gdn_mixer_region":  # gdn_fused's region, op by op
        ops = BoundOps(backend)
        with ops.step(ctx):
            out.copy_(gdn_mixer_region(ops, x["qkv"], x["z"], x["b"], x["a"], w["conv_weight"], w["A_log"],
                                       w["dt_bias"], lambda y, gate: gated_rms_norm(y, gate, w["norm_weight"], 1e-6),
                                       LAYER, HK, DK, SCALE))
    elif op == "gdn_fused":
        backend.gdn_fused(ctx, x["qkv"], x["z"], x["b"], x["a"], w["conv_weight"], w["A_log"], w["dt_bias"],
                          w["norm_weight"], out, LAYER, HK, SCALE, 1e-6)
    elif op == "lightning_core":
        backend.lightning_core(ctx, x["q"], x["k"], x["v"], w["decay"], out, LAYER, SCALE)
    else:
        getattr(backend, op)(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, LAYER, SCALE)
    return out


def pools(initial: dict[str, torch.Tensor]):
    """Fresh pools whose slot 1 + b holds request b's state before the step (`initial[entry][b]`)."""
    state_pool, kv_pool = StatePool(REGISTRY, len(REQUESTS)), KVPool(REGISTRY, 32, 4)
    for name, t in state_pool.layer(LAYER).items():
        t[1:1 + len(REQUESTS)] = initial[name]
    return state_pool, kv_pool, SnapshotPool(REGISTRY, len(REQUESTS))


def run(op: str, initial, requests: list[tuple[int, int, list[int], int | None]], x, pad: int = 0):
    """One step of `requests` ((request b, cached, rows of x, snapshot id or None)) on fresh pools,
    `pad` padding tokens and requests; (outputs of the real rows, state pool, snapshot pool)."""
    state_pool, kv_pool, snapshots = pools(initial)
    backend = CPUReferenceBackend(kv_pool, state_pool, snapshots=snapshots)
    items = []
    for b, cached, rows, snapshot in requests:
        seq = SeqState(1 + b, kv_pool.alloc(kv_pool.pages_for(cached)), cached)
        if snapshot is not None:
            seq.snapshot = (cached + REQUESTS[b][2], snapshot)
        items.append((seq, [0] * len(rows)))
    step = build_step(items, kv_pool, pad_tokens_to=sum(len(r) for *_, r, _ in requests) + pad,
                      pad_seqs_to=len(requests) + pad)
    index = torch.tensor([i for _, _, rows, _ in requests for i in rows])
    rows_x = {name: torch.cat([t[index], t[:pad]]) for name, t in x.items()}  # padding rows: any values
    out = call(op, backend, step.ctx, rows_x)
    return out[:len(index)], state_pool, snapshots


def padded_step(op: str):
    """The state before the step, the step's requests, its inputs, and (outputs, state pool,
    snapshot pool) after the step of every request of REQUESTS, padded; request b writes snapshot b."""
    g = torch.Generator().manual_seed(0)
    initial = {name: torch.randn(len(REQUESTS), *t.shape[1:], generator=g)
               for name, t in StatePool(REGISTRY, 1).layer(LAYER).items()}
    starts = [sum(n for _, n, _ in REQUESTS[:b]) for b in range(len(REQUESTS))]
    x = token_inputs(op, sum(n for _, n, _ in REQUESTS), g)
    step = [(b, cached, list(range(s, s + n)), None if row is None else b)
            for b, ((cached, n, row), s) in enumerate(zip(REQUESTS, starts))]
    return initial, starts, x, run(op, initial, step, x, pad=3)


@pytest.mark.parametrize("op", OPS)
def test_each_linear_op_writes_the_state_after_the_snapshot_row_as_a_step_of_those_rows_alone(op):
    initial, starts, x, (out, states, snapshots) = padded_step(op)
    for b, ((cached, n, row), s) in enumerate(zip(REQUESTS, starts)):
        if row is None:
            continue
        whole = list(range(s, s + n))
        first_out, first, _ = run(op, initial, [(b, cached, whole[:row], None)], x)
        later = {name: t[1 + b][None].expand(len(REQUESTS), *t.shape[1:]).clone()
                 for name, t in first.layer(LAYER).items()}
        rest_out, rest, _ = run(op, later, [(b, cached + row, whole[row:], None)], x)
        for name in WRITES.get(op, ("recurrent",)):
            assert torch.equal(snapshots.buffers[LAYER][name][b], first.layer(LAYER)[name][1 + b]), (b, name)
            assert torch.equal(states.layer(LAYER)[name][1 + b], rest.layer(LAYER)[name][1 + b]), (b, name)
        assert torch.equal(out[s:s + n], torch.cat([first_out, rest_out])), b
    for name in WRITES.get(op, ("recurrent",)):  # request 1 has no snapshot row: id 1 is never written
        assert not snapshots.buffers[LAYER][name][1].any() and snapshots.buffers[LAYER][name][0].any()


def test_gdn_fused_writes_what_its_region_writes_op_by_op():
    (*_, (fused_out, fused, fused_snapshots)), (*_, (out, states, snapshots)) = (
        padded_step("gdn_fused"), padded_step("gdn_mixer_region"))
    assert torch.equal(fused_out, out)
    for name in WRITES["gdn_fused"]:
        assert torch.equal(fused.layer(LAYER)[name], states.layer(LAYER)[name]), name
        assert torch.equal(fused_snapshots.buffers[LAYER][name], snapshots.buffers[LAYER][name]), name
        assert snapshots.buffers[LAYER][name][0].any() and not snapshots.buffers[LAYER][name][1].any()


def test_a_backend_writes_step_snapshots_into_its_own_pool_and_a_set_only_if_every_linear_member_does():
    state_pool, kv_pool, snapshots = pools({name: 0 for name in ("recurrent", "conv")})
    writer = CPUReferenceBackend(kv_pool, state_pool, snapshots=snapshots)
    assert writer.writes_step_snapshots(snapshots)
    assert not writer.writes_step_snapshots(SnapshotPool(REGISTRY, 1)) and not writer.writes_step_snapshots(None)
    assert not CPUReferenceBackend(kv_pool, state_pool).writes_step_snapshots(snapshots)
    assert not TritonLinearBackend(state_pool).writes_step_snapshots(snapshots)
    moe_only = Spy({"moe"})  # owns no linear state: not asked
    assert BackendSet({"ref": writer, "moe": moe_only}, {}).writes_step_snapshots(snapshots)
    assert not BackendSet({"ref": writer, "conv": Spy({"short_conv"})}, {}).writes_step_snapshots(snapshots)
