"""Extend buckets chosen from measured step costs: `hgc compile --bucket-costs FILE`.

A bucket is worth capturing where a step padded into it costs clearly less than the same step
padded into the next larger bucket kept: each bucket adds graphs to capture and check at start-up
and their activations to the graph pool (docs/DESIGN.md, "Short extends get buckets of their own").
Going from the largest measured bucket down, a bucket is kept when its step costs at most
(1 - MIN_SAVING) of the last kept one's; the largest is always kept, since it bounds the chunk a
captured step may carry. The costs come from a bucket-costs document
(compiler/splitops/artifact.py `bucket_costs_doc`), written on the target device by
benchmarks/serving/bucket_costs.py, and are recorded in the manifest beside the choice.

What it does not do: measure (the benchmark does) or write the manifest (compiler/artifact_writer.py).
"""

from __future__ import annotations

from pathlib import Path

from compiler.splitops.artifact import (BUCKET_COSTS_FORMAT, ArtifactFormatError, BucketCosts, load_json,
                                        parse_bucket_costs)

__all__ = ["MIN_SAVING", "read_bucket_costs", "choose_extend_buckets"]

# A smaller bucket must save at least this share of the next kept bucket's step: a tenth, so that
# buckets whose steps cost alike (launch-bound sizes) are not all captured.
MIN_SAVING = 0.1


def read_bucket_costs(path: str | Path) -> BucketCosts:
    """The costs in a bucket-costs file; ArtifactFormatError names the file and field at fault."""
    doc = load_json(path, "bucket costs")
    if not isinstance(doc, dict) or doc.get("format") != BUCKET_COSTS_FORMAT:
        raise ArtifactFormatError(f"{path}: field 'format' must be {BUCKET_COSTS_FORMAT!r} (written by "
                         f"benchmarks/serving/bucket_costs.py)")
    return parse_bucket_costs(doc, str(path))


def choose_extend_buckets(costs: BucketCosts, min_saving: float = MIN_SAVING) -> tuple[int, ...]:
    """The extend buckets to capture, increasing: the largest measured, and each smaller one whose
    step costs at most (1 - min_saving) of the last one kept above it."""
    kept: list[tuple[int, float]] = []
    for tokens, ms in reversed(costs.extend_ms):
        if not kept or ms <= (1 - min_saving) * kept[-1][1]:
            kept.append((tokens, ms))
    return tuple(sorted(t for t, _ in kept))
