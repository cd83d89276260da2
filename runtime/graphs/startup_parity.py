"""Start-up parity: a captured runner's keys checked against eager before anything is served.

`check_parity(runner, vocab_size=...)` runs after `GraphRunner.capture()` (`GraphRunner.start` does
both). For each captured key, real requests that fill it only in part (`parity_items`) run three
times from the same caches and states (`_check_key`):

1. eagerly, padded to the key: the reference;
2. eagerly, unpadded, every op on the inputs run 1 handed it (TeacherForcing,
   runtime/graphs/parity.py): what padding changes for a real request;
3. the key's graphs, padded: what capture changes.

Every op's real rows, the logits, the states and KV written for the real requests must agree
within the compute dtype's tolerance, and the padding slot and unowned pages must not change;
otherwise ParityError names the mode, the bucket and the first layer that differs, and the runner
refuses to serve. (A padded replay checked only against a padded eager run would pass a padding
fault both share.) With compiled pieces (runtime/artifact/bundle.py), each key's padded step is
first run with the traced glue and compared op by op with the compiled pieces
(runtime/graphs/compiled_parity.py): the reference of the other runs is then known to be the
graph's own.

What the check found is kept in the runner's `ParityRecord` (`runner.parity`), per key, whether or
not the key passed: benchmarks read its timings and op-by-op errors. This module captures nothing
and replays through the runner's own `run_outputs`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

import torch

from compiler.splitops import Mode
from runtime.cache.batch import SeqState, StepInputs, build_step
from runtime.graphs.buckets import CaptureKey
from runtime.graphs.compiled_parity import compare_compiled
from runtime.graphs.cuda_graphs import CaptureError
from runtime.graphs.parity import (CacheWatch, OpTrace, ParityError, TeacherForcing, beyond_drift, first_difference,
                                   rel_err, rtol_for)

__all__ = ["ParityRecord", "check_parity", "parity_items", "release_items"]

Items = list[tuple[SeqState, list[int]]]


@dataclasses.dataclass
class ParityRecord:
    """What a runner's start-up check found, per key (`str(key)`), kept whether or not the key passed."""

    compiled: dict[str, dict] = dataclasses.field(default_factory=dict)  # compiled pieces against the traced glue
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall seconds of the key's check
    phases: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # seconds per run of _check_key
    # run 2 op by op (each op's glue and output error, the logits'): what benchmarks/probes/parity_drift_probe.py reports
    errors: dict[str, dict] = dataclasses.field(default_factory=dict)


def parity_items(runner, key: CaptureKey, vocab_size: int, generator: torch.Generator) -> Items:
    """Real requests (slots and pages of their own) that fill `key` only in part, for `check_parity`.

    Fewer requests than the bucket holds, so the replay has padded requests on the padding
    slot (and, in extend, padding rows): what a padding fault needs to show. Decode and
    target_verify: one request fewer than the bucket (a bucket of one: one), each with 1 to 40
    cached tokens (whatever its pages hold: both runs read the same) and 1 or verify_tokens
    new ones. Extend: up to 3 fresh requests of different lengths covering about three
    quarters of the bucket's rows. Free them with `release_items`.
    """
    def tokens(n):
        return torch.randint(1, vocab_size, (n,), generator=generator).tolist()

    state_pool = runner.state_pool
    free = state_pool.num_free
    if free < 1:
        raise CaptureError("parity check: no free state slot for a request")
    cap = runner.max_pages * runner.kv_pool.page_size  # the longest request the runner takes
    if key.mode in (Mode.DECODE, Mode.TARGET_VERIFY):
        new = runner.buckets.verify_tokens if key.mode == Mode.TARGET_VERIFY else 1
        lens = [1 + (7 * b) % max(1, min(40, cap - new)) for b in range(min(max(1, key.seqs - 1), free))]
        return [(SeqState(state_pool.alloc(), num_cached=c), tokens(new)) for c in lens]
    # 3 requests, not "as many as fit": the shapes start-up runs (and the kernels they build) stay
    # the same under any limits that leave 3 slots free, so a bundle built under other limits covers them
    n = min(key.seqs - 1, 3, free) or 1
    budget = max(n, 3 * key.tokens // 4)
    lens = [max(1, budget >> (i + 1)) for i in range(n - 1)]
    lens.append(max(1, budget - sum(lens)))
    return [(SeqState(state_pool.alloc()), tokens(min(m, cap))) for m in lens]


def release_items(runner, items: Items) -> None:
    """Give back the pages and state slots of requests made by `parity_items`."""
    for seq, _ in items:
        runner.kv_pool.free(seq.pages)
        seq.pages = []
        runner.state_pool.free(seq.slot)


def check_parity(runner, make_items: Optional[Callable[[CaptureKey], Items]] = None, *,
                 vocab_size: Optional[int] = None, rtol: Optional[float] = None, seed: int = 0,
                 log: Callable[[str], None] = lambda line: None) -> dict[str, float]:
    """Replay each of the runner's keys padded against eager unpadded; raise ParityError naming what differs.

    make_items(key) returns real requests that fill the key in part (default: `parity_items`
    with random token ids below vocab_size; those are released again here). rtol: the
    tolerance (default: `runtime.graphs.parity.PARITY_RTOL` for the model's compute dtype). Returns
    the logits' relative error per key; `log` gets a summary line (two with compiled pieces).
    """
    if make_items is None:
        if vocab_size is None:
            raise ValueError("check_parity: pass make_items or vocab_size")
        generator = torch.Generator().manual_seed(seed)
        make_items = lambda key: parity_items(runner, key, vocab_size, generator)  # noqa: E731
        release = lambda items: release_items(runner, items)  # noqa: E731
    else:
        release = lambda items: None  # noqa: E731 - the caller owns its requests
    t0 = time.perf_counter()
    report = {}
    for key in runner.keys:
        items = make_items(key)
        began = time.perf_counter()
        try:
            report[str(key)] = _check_key(runner, key, items, rtol)
        finally:
            release(items)
            runner.parity.seconds[str(key)] = time.perf_counter() - began
    worst = max(report.values(), default=0.0)
    log(f"start-up parity: {len(report)} keys match eager (worst rel err {worst:.2g}) in "
        f"{time.perf_counter() - t0:.1f} s")
    compiled = runner.parity.compiled.values()
    if compiled:
        log(f"compiled pieces match the traced glue on every key: worst op input rel err "
            f"{max(r['worst_op'] for r in compiled):.2g}, logits {max(r['logits'] for r in compiled):.2g}")
    return report


def _check_key(runner, key: CaptureKey, items: Items, rtol: Optional[float]) -> float:
    """One key, the three runs of the module's docstring from the same caches.

    Runs 2 and 3 must leave the padding slot and the pages no real request owns as they were.
    Together: a padded replay computes real requests as an unpadded eager step does, within
    the compute dtype's tolerance, without the rounding of differently shaped kernels growing
    through later layers into a false alarm. Returns run 3's logits error.
    """
    kv_pool, record, name = runner.kv_pool, runner.parity, str(key)
    logits_rows = [runner.buckets.verify_logits_rows] * len(items) if key.mode == Mode.TARGET_VERIFY else None
    padded = build_step(items, kv_pool, "cpu", mode=key.mode, pad_tokens_to=key.tokens,
                        pad_seqs_to=key.seqs, max_pages=runner.max_pages, logits_rows=logits_rows)
    plain = build_step(items, kv_pool, "cpu", mode=key.mode, max_pages=runner.max_pages,
                       logits_rows=logits_rows)  # pages taken above
    rows = plain.ctx.num_real_tokens
    padded = runner.staging.with_random_hidden(padded, torch.Generator().manual_seed(rows))
    plain = dataclasses.replace(plain, hidden=None if padded.hidden is None else padded.hidden[:rows])
    slots, pages = [seq.slot for seq, _ in items], [p for seq, _ in items for p in seq.pages]
    # target_verify writes intermediate states in the rows of the step's real requests
    verify_rows = len(items) if key.mode == Mode.TARGET_VERIFY else 0
    marks = [("start", time.perf_counter())]  # each later mark names the run that ended there
    watch = CacheWatch(kv_pool, runner.state_pool, slots, pages, verify_rows=verify_rows)
    if getattr(runner.program, "glue", None) is not None:
        # Compiled pieces run both sides of the checks below: first they are compared with the
        # traced glue itself, op by op (runtime/graphs/compiled_parity.py).
        report = compare_compiled(runner.program, runner.ops, kv_pool, runner.state_pool, padded, slots, pages,
                                  runner.chunk_size, rtol, verify_rows=verify_rows)
        record.compiled[name] = {**report, "key": name}
        watch.restore()
    problems: list[str] = []

    marks.append(("compiled_vs_traced", time.perf_counter()))
    reference = OpTrace(rows, inputs=True)
    ref_logits = _observed_run(runner, padded, None, observer=reference)
    ref_written = watch.written()
    rtol = rtol if rtol is not None else rtol_for(reference.records[0].out.dtype if reference.records
                                                  else torch.float32)
    watch.restore()

    marks.append(("reference", time.perf_counter()))
    forced = TeacherForcing(reference.records)
    plain_logits = _observed_run(runner, plain, None, intercept=forced)
    where, err = forced.first_beyond(rtol), _outputs_err(plain_logits, ref_logits)
    record.errors[name] = {"real_rows": rows, "logits": err, "per_op": [
        {"layer": r.layer, "op": r.op, "glue": g, "op_err": o}
        for r, g, o in zip(reference.records, forced.glue, forced.ops)]}
    if where or beyond_drift(err, forced.carried, rtol):  # the logits inherit the glue's drift
        problems.append(f"unpadded against padded eager, op by op: first differing: "
                        f"{where or f'the logits (rel err {err:.3g})'}")
    problems += _cache_problems(watch, ref_written, rtol, "unpadded against padded eager", "unpadded eager run")
    watch.restore()

    marks.append(("unpadded", time.perf_counter()))
    rerun = OpTrace(rows) if runner.graphs.replays_call_ops else None
    graph_logits = _observed_run(runner, padded, key, observer=rerun)
    err = _outputs_err(graph_logits, ref_logits)
    where = first_difference(reference.records, rerun.records if rerun else runner.op_outs[key], rtol, rows)
    if where or not math.isfinite(err) or err > rtol:
        problems.append(f"replay against padded eager: logits rel err {err:.3g}; first differing: "
                        f"{where or 'no single op output (the difference is in the pieces between ops)'}")
    problems += _cache_problems(watch, ref_written, rtol, "replay against padded eager", "replay")
    marks.append(("replay", time.perf_counter()))
    record.phases[name] = {run: round(t - marks[i][1], 4) for i, (run, t) in enumerate(marks[1:])}
    if problems:
        raise ParityError(f"start-up parity: {key} with {len(items)} real request(s) and {rows} real row(s): "
                          f"{'; '.join(problems)}; refusing to serve")
    return err


def _cache_problems(watch: CacheWatch, reference: dict, rtol: float, against: str, run: str) -> list[str]:
    """What a run wrote for a real request beyond rtol of the reference run's writes, and what it
    touched outside the real requests' slots and pages, each named."""
    written = watch.differences(reference, watch.written(), rtol)
    problems = [f"{against}: written for a real request: {written}"] if written else []
    return problems + [f"the {run} touched {what}" for what in watch.touched_outside()]


def _observed_run(runner, step: StepInputs, key: Optional[CaptureKey], *, observer=None,
                  intercept=None) -> list[torch.Tensor]:
    """runner.run_outputs() with an observer or an intercept on the op table for this step only:
    copies of every output (the logits, and the hidden states where the program returns them)."""
    ops = runner.ops
    ops.observer, ops.intercept = observer, intercept
    try:
        return [o.clone() for o in runner.run_outputs(step, key)]
    finally:
        ops.observer = ops.intercept = None


def _outputs_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error over a step's outputs (logits, and hidden states where returned)."""
    return max(rel_err(a, b) for a, b in zip(got, want))
