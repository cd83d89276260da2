"""The symmetric-memory all-reduce on two GPUs against NCCL's, eager and inside a CUDA graph.

testkit/collective_checks.py holds the check (benchmarks/kernels/allreduce_bench.py runs it before timing):
bf16 and float32, one element to past the one-shot buffer, aligned tensors (one kernel) and views
off the 16-byte grid (staged), then the three paths captured in one graph and replayed with new
values. Two ranks: every sum must equal NCCL's bit for bit.

Marked gpu (CI deselects it); needs two GPUs on one host.
"""

from __future__ import annotations

import pytest
import torch

from testkit.collective_checks import check_against_nccl, run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_symmetric_memory_all_reduce_equals_nccl_eager_and_in_graph_replays():
    per_rank = run_ranks(check_against_nccl, world=2)
    for rank, rows in enumerate(per_rank):
        bad = [r for r in rows if not r["ok"]]
        assert not bad, f"rank {rank}: {bad}"
        paths = {(r["path"], r["how"].split()[0]) for r in rows}
        assert {("one_shot", "eager"), ("staged", "eager"), ("nccl", "eager"), ("one_shot", "graph"),
                ("staged", "graph"), ("nccl", "graph")} <= paths, paths
