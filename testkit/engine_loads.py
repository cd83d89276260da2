"""Engine loads for the tests of the overlapped schedule (CPU and GPU): jobs joining over time, driven
step by step, with the checks every run must pass (tests/runtime/engine/test_overlap.py)."""

from __future__ import annotations

import dataclasses

from runtime.engine.engine import Engine, SamplingParams

__all__ = ["Job", "drive", "assert_all_free"]


@dataclasses.dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    at_step: int = 0  # the step before which it is added
    share_with: int | None = None  # the job whose prefill it shares (added right after it, in the same step)
    cancel_after: int | None = None  # cancelled once this many of its tokens were streamed


def drive(engine: Engine, jobs: list[Job]) -> dict[int, tuple[tuple[int, ...], str]]:
    """Run the jobs; {job: (its tokens, its finish reason)}. Checks what every run must hold: no
    output after a request's finished one, the streamed tokens are the result's, all is free after."""
    ids, streamed, results, step = {}, {i: [] for i in range(len(jobs))}, {}, 0
    while len(ids) < len(jobs) or engine.has_work():
        for i, job in enumerate(jobs):
            if job.at_step == step:
                parent = ids[job.share_with] if job.share_with is not None else None
                ids[i] = engine.add_request(job.prompt, job.params, prefill_from=parent)
        by_id = {rid: i for i, rid in ids.items()}
        for out in engine.step():
            i = by_id[out.request_id]
            assert i not in results, f"job {i}: an output after its finished one"
            if out.token is not None:
                streamed[i].append(out.token)
            if out.finished:
                results[i] = engine.pop_result(out.request_id)
        for i, job in enumerate(jobs):
            if job.cancel_after is not None and i in ids and i not in results and len(streamed[i]) >= job.cancel_after:
                assert engine.cancel(ids[i])
                results[i] = engine.pop_result(ids[i])
        step += 1
        assert step < 2000, "the load does not finish"
    assert sorted(results) == list(range(len(jobs)))
    for i, result in results.items():
        assert list(result.output_ids) == streamed[i], f"job {i}: the result is not what was streamed"
    assert_all_free(engine)
    return {i: (result.output_ids, result.finish_reason) for i, result in results.items()}


def assert_all_free(engine: Engine) -> None:
    """Every slot and page back (the prefix cache's reclaimable pages count as free), every snapshot too."""
    stats = engine.stats()
    assert not engine.has_work() and stats["running"] == stats["queue_depth"] == 0, stats
    assert stats["free_slots"] == stats["total_slots"], stats
    assert stats["free_pages"] == stats["total_pages"], stats
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        assert engine.kv_pool.num_free == engine.kv_pool.num_pages
        snapshots = engine.prefix_cache.snapshots
        assert snapshots.num_free == snapshots.num_snapshots
