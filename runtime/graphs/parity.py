"""Padded against unpadded: the pieces of a check that padding changes nothing a real request sees.

A captured graph runs a step padded to its bucket: token rows past the real ones, and requests
past the real ones on the reserved padding slot (runtime/cache/batch.py). The same requests run eagerly
are not padded. Padding must not change a real row's output, the state written to a real
request's slot or the KV written to its pages, and must leave the padding slot and every page no
real request owns as they were. A check that pads both sides alike cannot see a fault that padding
causes (DESIGN.md, failure 8), so the start-up parity check (runtime/graphs/startup_parity.py) and the
layer-by-layer probe (benchmarks/probes/padding_probe.py) compare a padded run with an unpadded one, using:

1. `OpTrace`: a BoundOps observer that keeps, for each op call, its layer id, op name and the
   real rows of its `out` (optionally of its per-token inputs too), copied when the call returns.
2. `CacheWatch`: made before a step from the real requests' slots and pages. It saves what the
   step may write (to restore it, so a second run starts from the same caches), a copy of the
   padding slot and a fingerprint of every page no real request owns; `written()` reads the real
   slots and pages after a run, `touched_outside()` names what changed outside them. For a
   target_verify step it also watches the intermediate states of the real requests' rows (the
   rows of padded requests may be written: no real request reads them).
3. `first_difference` and `CacheWatch.differences`: the comparisons, each naming the first layer,
   op, slot entry or page whose relative error exceeds the tolerance.

Tolerances are per compute dtype (`PARITY_RTOL`): a padded and an unpadded step may run different
kernels for the glue between ops (a matrix product of 256 rows is not always tiled like one of 126),
so they agree to rounding, not bit for bit. It does not capture, replay or decide buckets (the
graph runner does) and does not choose what to run (routing did).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from compiler.splitops import op_arguments, op_spec
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import PADDING_SLOT, StatePool

__all__ = ["ParityError", "PARITY_RTOL", "PARITY_DRIFT_LIMIT", "beyond_drift", "first_glue_fault", "OpRecord",
           "OpTrace", "TeacherForcing", "CacheWatch", "rel_err", "rel_err_tensor", "rtol_for", "first_difference",
           "op_arg_positions"]

class ParityError(RuntimeError):
    """A start-up check found a difference beyond tolerance: the runtime refuses to serve."""


# Relative error (of the norm) a padded replay may differ from the unpadded eager run by, per compute
# dtype: bf16 glue computed by differently tiled kernels agrees to a few 1e-3; float32 to ~1e-6.
PARITY_RTOL = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# Teacher forcing hands every op its reference inputs, but not what the glue carries past the ops
# (the residual stream; a dense MLP, all glue): their rounding travels from layer to layer and adds
# up with depth. On a 64-layer dense bf16 model (Qwen3.6-27B's shape) the inputs of later layers
# drifted 7e-3 to 2e-2 apart between a padded and an unpadded step, every op bit-identical on the
# same inputs (benchmarks/probes/parity_drift_probe.py). So a glue error (and the logits') is held to the
# tolerance for what it adds over the largest glue error before it, and what it carries to this
# many tolerances: a fault that enters in one piece still fails at the tolerance.
PARITY_DRIFT_LIMIT = 4


def rtol_for(dtype: torch.dtype) -> float:
    return PARITY_RTOL.get(dtype, PARITY_RTOL[torch.bfloat16])


def beyond_drift(error: float, carried: float, rtol: float) -> bool:
    """Whether a glue (or logits) error is more than rounding carried from earlier pieces: not
    finite, more than rtol over `carried` (the largest glue error before it), or more than
    PARITY_DRIFT_LIMIT tolerances in all."""
    return not math.isfinite(error) or error - carried > rtol or error > PARITY_DRIFT_LIMIT * rtol


def first_glue_fault(errors: list[float], rtol: float) -> Optional[tuple[int, float]]:
    """The first glue error (per op, in call order) beyond_drift of those before it, as (its index,
    the largest error before it); None if none."""
    carried = 0.0
    for i, error in enumerate(errors):
        if beyond_drift(error, carried, rtol):
            return i, carried
        carried = max(carried, error)
    return None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32 (0 when both are zero; inf when only b is)."""
    return float(rel_err_tensor(a, b))


def rel_err_tensor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """rel_err as a 0-dim tensor on the tensors' device: no wait for the device until it is read."""
    return _row_rel_errs(a.reshape(1, -1), b.reshape(1, -1))[0]


def _row_rel_errs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """rel_err(a[i], b[i]) for every leading index i at once, in float32 on the tensors' device.

    Six small ops: a start-up check computes a few thousand of these, each a handful of kernel
    launches on the GPU. The norms convert to float32 as they read (no float32 copies of a and b);
    a - b stays in the inputs' dtype, whose rounding of the difference is far below any tolerance.
    0/0 (both zero) is 0; x/0 is inf; a NaN anywhere stays NaN."""
    a, b = (t.reshape(t.shape[0], -1) if t.dim() > 1 else t.unsqueeze(1) for t in (a, b))
    num = torch.linalg.vector_norm(a - b, dim=1, dtype=torch.float32)
    den = torch.linalg.vector_norm(b, dim=1, dtype=torch.float32)
    return torch.where(num == 0, num, num / den)


def op_arg_positions(op: str) -> dict[str, int]:
    """Argument name -> position in the op's schema (the order the observer receives them in)."""
    return {name: i for i, name in enumerate(op_arguments(op))}


@dataclasses.dataclass
class OpRecord:
    layer: int
    op: str
    out: torch.Tensor  # the real rows of the op's `out`, as it left the op
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # real rows of per-token inputs


class OpTrace:
    """A BoundOps observer: one OpRecord per op call, with the first `real_rows` rows of its tensors.

    `skip()` says when a call is not the step's own (a warm-up before a capture). `inputs=True`
    also keeps the op's per-token inputs (its declared `token_args`), so a comparison can tell an op
    that computes differently from one that was handed different inputs. `copy=False` keeps the
    tensors themselves instead of copies: the graph runner's capture does, to read the values a
    later replay leaves in them.
    """

    def __init__(self, real_rows: int, *, inputs: bool = False, skip: Callable[[], bool] = lambda: False,
                 copy: bool = True):
        self.real_rows, self.inputs, self.skip, self.copy = real_rows, inputs, skip, copy
        self.records: list[OpRecord] = []

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        return t[: self.real_rows].detach().clone() if self.copy else t

    def __call__(self, name: str, args: tuple) -> None:
        if self.skip():
            return
        at = op_arg_positions(name)
        inputs = {arg: self._keep(args[at[arg]]) for arg in op_spec(name).token_args} if self.inputs else {}
        self.records.append(OpRecord(int(args[at["layer_id"]]), name, self._keep(args[at["out"]]), inputs))


class TeacherForcing:
    """A BoundOps intercept: each op of a step runs on the inputs another run of the same real
    requests handed that op, and the rest of the step continues from that run's output.

    Given the records (inputs kept) of a padded run, an unpadded run of the same requests under
    this intercept compares, for every op call, free of what earlier ops did differently:

    - `glue[i]`: the inputs this run computed for op i against the padded run's: what the pieces
      between ops did differently (rounding of kernels picked by the number of rows), including
      what the glue carries past the ops unforced (the residual stream), hence `first_glue_fault`'s
      drift rule;
    - `ops[i]`: op i's output on the padded run's own inputs against the padded run's output:
      what padding changed inside the op (a padding fault, or a kernel picked by the row count).

    Both runs then write states and KV from the same inputs, so those compare tightly too. Without
    it, a rounding difference in the first layer's glue reaches a near tie of an MoE router a few
    layers on, flips an expert and grows to percents at the logits (benchmarks/probes/padding_probe.py).
    """

    def __init__(self, reference: list[OpRecord]):
        self.reference = reference
        # Errors stay on the device until read: one read for the whole step, not one wait for the
        # device per op input (hundreds per start-up key).
        self._glue: list[torch.Tensor] = []
        self._ops: list[torch.Tensor] = []
        self._read: tuple[list[float], list[float]] | None = None

    def __call__(self, name: str, method, ctx, args: tuple) -> None:
        i = len(self._ops)
        ref = self.reference[i] if i < len(self.reference) else None
        at = op_arg_positions(name)
        if ref is None or (ref.layer, ref.op) != (int(args[at["layer_id"]]), name):
            raise RuntimeError(f"teacher forcing: call {i} is layer {int(args[at['layer_id']])} ({name}), the "
                               f"reference run's is {ref and (ref.layer, ref.op)}: the runs are not of one program")
        n = ref.out.shape[0]
        errs = []
        for arg, value in ref.inputs.items():
            given = args[at[arg]]
            errs.append(rel_err_tensor(given[:n], value))
            given[:n].copy_(value)  # in place: the op sees the layout this run made
        # the largest, NaN kept (max() of floats would drop a NaN that comes second)
        self._glue.append(torch.stack(errs).amax() if errs else ref.out.new_zeros((), dtype=torch.float32))
        method(ctx, *args)
        out = args[at["out"]]
        self._ops.append(rel_err_tensor(out[:n], ref.out))
        out[:n].copy_(ref.out)
        self._read = None

    def _errors(self) -> tuple[list[float], list[float]]:
        if self._read is None:
            both = self._glue + self._ops
            values = torch.stack([e.to(both[0].device) for e in both]).tolist() if both else []
            self._read = (values[: len(self._glue)], values[len(self._glue):])
        return self._read

    @property
    def glue(self) -> list[float]:
        """Per op call: the relative error of the inputs this run computed against the reference's."""
        return self._errors()[0]

    @property
    def ops(self) -> list[float]:
        """Per op call: the relative error of its output on the reference's inputs."""
        return self._errors()[1]

    @property
    def carried(self) -> float:
        """The largest glue error of the step: the drift the logits inherit (`beyond_drift`)."""
        return max((e for e in self.glue if math.isfinite(e)), default=0.0)

    def first_beyond(self, rtol: float) -> Optional[str]:
        """The first op whose output on the same inputs exceeds rtol, or whose inputs the glue
        computed beyond the drift rule (`first_glue_fault`), named; None if none."""
        at, carried = first_glue_fault(self.glue, rtol) or (None, 0.0)
        for i, (ref, glue, op) in enumerate(zip(self.reference, self.glue, self.ops)):
            if i == at:
                return (f"the pieces before layer {ref.layer} ({ref.op}: its inputs' rel err {glue:.3g}, "
                        f"{carried:.3g} carried from earlier layers)")
            if not math.isfinite(op) or op > rtol:
                return f"layer {ref.layer} ({ref.op}, rel err {op:.3g} on the same inputs)"
        return None


def overwritten_later(records: list[OpRecord]) -> set[int]:
    """Indices of records whose `out` a later op call wrote in place.

    A record kept by reference (a captured graph's op outputs, OpTrace with copy=False) shows its
    tensor as it is after the replay. In a tensor-parallel program `hgc.all_reduce` sums a partial
    output where it lies, so the record of the op that made the partial shows the sum: compared
    with an eager copy taken before the sum it would be a false alarm. Records kept alive by
    reference cannot share memory otherwise (the allocator cannot reuse a live tensor's storage),
    so a shared data pointer means an in-place write."""
    last: dict[int, int] = {}
    stale: set[int] = set()
    for i, record in enumerate(records):
        ptr = record.out.data_ptr()
        if ptr in last:
            stale.add(last[ptr])
        last[ptr] = i
    return stale


def first_difference(reference: list[OpRecord], other: list[OpRecord], rtol: float,
                     real_rows: Optional[int] = None) -> Optional[str]:
    """The first op call whose output differs beyond rtol, as 'layer N (op, rel err E)'; None if none.

    Both lists must come from the same program (same calls in the same order); `real_rows` cuts
    records kept whole (OpTrace with copy=False) to the real rows."""
    if len(reference) != len(other):
        return f"the runs made {len(reference)} and {len(other)} op calls"
    stale = overwritten_later(other)
    compared = []
    for i, (ref, got) in enumerate(zip(reference, other)):
        if (ref.layer, ref.op) != (got.layer, got.op):
            return f"the runs called layer {ref.layer} ({ref.op}) and layer {got.layer} ({got.op}) in the same place"
        if i in stale:  # holds a later op's result; that op's own record is compared instead
            continue
        # The real rows: the first `real_rows`, or fewer where an op's rows are the step's logits
        # rows rather than its tokens (the lm_head gather of a tensor-parallel program: a replay
        # gathers the padded requests' rows too, an unpadded run the real requests' only).
        n = min(got.out.shape[0], ref.out.shape[0], real_rows if real_rows is not None else ref.out.shape[0])
        compared.append((ref, rel_err_tensor(got.out[:n], ref.out[:n])))
    # one wait for the device, not one per op
    errs = torch.stack([e.to(compared[0][1].device) for _, e in compared]).tolist() if compared else []
    for (ref, _), err in zip(compared, errs):
        if not math.isfinite(err) or err > rtol:
            return f"layer {ref.layer} ({ref.op}, rel err {err:.3g})"
    return None


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Per leading index: the sum and the L2 norm of its entries, in float32, without a copy of `t`
    (both are reductions that convert as they read: a KV pool may be most of the GPU's memory)."""
    flat = t.reshape(t.shape[0], -1)
    return torch.stack([flat.sum(1, dtype=torch.float32),
                        torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32)], dim=1)


class CacheWatch:
    """The caches around one step of some real requests (their state slots and KV pages)."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, slots: list[int], pages: list[int],
                 verify_rows: int = 0):
        """verify_rows: the real requests of a target_verify step (rows 0 .. verify_rows - 1 of
        the state pool's intermediate states); 0 for any other step."""
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.verify_rows = verify_rows
        self.slots = sorted(set(int(s) for s in slots))
        self.pages = sorted(set(int(p) for p in pages))
        self._slot_index = torch.tensor(self.slots, dtype=torch.long, device=state_pool.device)
        self._page_index = torch.tensor(self.pages, dtype=torch.long, device=kv_pool.device)
        owned = torch.zeros(kv_pool.num_pages, dtype=torch.bool)
        owned[self.pages] = True
        self._unused = (~owned).nonzero().flatten().to(kv_pool.device)
        self._saved = self._read()
        self._padding = {(layer, name): t[PADDING_SLOT].clone() for layer, name, t in self._states()}
        self._fingerprints = {(layer, name): _fingerprint(t)[self._unused] for layer, name, t in self._kv()}

    def _states(self):
        for layer, entries in self.state_pool.buffers.items():
            for name, t in entries.items():
                yield layer, name, t

    def _kv(self):
        for layer, entries in self.kv_pool.buffers.items():
            for name, t in entries.items():
                yield layer, name, t

    def _verify(self):
        if not self.verify_rows:
            return
        for layer, entries in self.state_pool.verify_buffers.items():
            for name, t in entries.items():
                yield layer, name, t

    def _read(self) -> dict[tuple[str, int, str], torch.Tensor]:
        # indexing by a tensor gathers into a new tensor already: no clone needed (a slice is a view)
        values = {("state", layer, name): t[self._slot_index] for layer, name, t in self._states()}
        values.update({("kv", layer, name): t[self._page_index] for layer, name, t in self._kv()})
        values.update({("verify", layer, name): t[: self.verify_rows].clone() for layer, name, t in self._verify()})
        return values

    def written(self) -> dict[tuple[str, int, str], torch.Tensor]:
        """The real slots' states and the real pages' KV as they are now."""
        return self._read()

    def restore(self) -> None:
        """Put the real slots and pages back as they were when the watch was made."""
        for (where, layer, name), values in self._saved.items():
            if where == "verify":
                self.state_pool.verify_buffers[layer][name][: self.verify_rows] = values
                continue
            pool = self.state_pool if where == "state" else self.kv_pool
            index = self._slot_index if where == "state" else self._page_index
            pool.buffers[layer][name][index] = values

    def touched_outside(self) -> list[str]:
        """What changed since the watch was made outside the real slots and pages: the padding slot's
        entries and the pages no real request owns."""
        # every verdict computed on the device, then read back at once
        states = [(layer, name, (t[PADDING_SLOT] != self._padding[(layer, name)]).any())
                  for layer, name, t in self._states()]
        kv = [(layer, name, (_fingerprint(t)[self._unused] != self._fingerprints[(layer, name)]).any(1))
              for layer, name, t in self._kv()]
        flags = torch.stack([f for *_, f in states] + [c.any() for *_, c in kv]).tolist() if states or kv else []
        problems = [f"the padding slot's {name} state of layer {layer}"
                    for (layer, name, _), flagged in zip(states, flags) if flagged]
        for (layer, name, changed), flagged in zip(kv, flags[len(states):]):
            if flagged:
                pages = self._unused[changed].tolist()
                problems.append(f"{len(pages)} page(s) no request owns in layer {layer}'s {name} "
                                f"(first: page {pages[0]})")
        return problems

    def differences(self, reference: dict, other: dict, rtol: float) -> Optional[str]:
        """The first real slot's state or real page's KV (two `written()` results) that differs beyond
        rtol, named with its layer, entry and slot or page; None if none."""
        # One reduction per entry and one read for all of them: a loop over rows waited for the
        # device once per slot or page (seconds at start-up for a bucket of 256 requests).
        keys = list(reference)
        errs = [_row_rel_errs(other[key], reference[key]) for key in keys]
        bad = [~(e <= rtol) for e in errs]  # NaN compares false: a non-finite error is bad too
        flags = torch.stack([b.any() for b in bad]).tolist() if bad else []
        for key, e, b, flagged in zip(keys, errs, bad, flags):
            if not flagged:
                continue
            where, layer, name = key
            i = int(b.nonzero()[0, 0])
            if where == "state":
                what = f"state in slot {self.slots[i]}"
            elif where == "kv":
                what = f"KV in page {self.pages[i]}"
            else:
                what = f"intermediate state of verify row {i}"
            return f"layer {layer}'s {name} {what} (rel err {float(e[i]):.3g})"
        return None
