"""Everything the runtime reads of an exported program, as text (`described`): two loads of one
program are the same program when their descriptions are equal. Shared by
tests/runtime/artifact/test_pt2_load.py and benchmarks/host/program_load_bench.py, which compare the
checked load with torch.export.load the same way."""

from __future__ import annotations


def described(ep) -> list[str]:
    """Everything the runtime reads of a program, as text: its code, signature, ranges, each node's value."""
    return [str(ep.graph), str(ep.graph_signature), str(ep.range_constraints),
            *(f"{n.name}: {n.meta.get('val')}" for n in ep.graph.nodes)]
