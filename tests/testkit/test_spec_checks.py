"""testkit/spec_checks.py's op-by-op locator: where a verify row's bits first part from its decode step's.

1. `first_parting` on hand-made op records: the first op handed another per-token input, or the
   first op that gave another output from the same inputs; None when every op agrees; a refusal
   when the two steps called other ops.
2. `verify_against_decode(trace_ops=True)` on a tiny qwen3_next on the CPU (every step eager, as
   the untraced run here): the same rows and errors as without the trace, and each row that is
   not the decode step's bits named at an op of the program.
"""

from __future__ import annotations

import pytest
import torch

from compiler.splitops.ops import OP_SPECS
from runtime.graphs.parity import OpRecord
from testkit.helpers import shared_artifact
from testkit.spec_checks import first_parting, verify_against_decode


def record(layer: int, op: str, out: list[float], x: list[float]) -> OpRecord:
    return OpRecord(layer, op, torch.tensor([out]), {"x": torch.tensor([x])})


def test_the_first_op_handed_other_inputs_is_named():
    verify = [record(0, "short_conv", [1.0], [2.0]), record(1, "gqa_attention", [5.0], [3.0])]
    decode = [record(0, "short_conv", [1.0], [2.0]), record(1, "gqa_attention", [6.0], [3.5])]
    found = first_parting(verify, 0, decode, 0)
    assert {k: found[k] for k in ("layer", "op", "index", "at")} == {"layer": 1, "op": "gqa_attention", "index": 1,
                                                                    "at": "input x"}
    assert found["rel_err"] == pytest.approx(0.5 / 3.5)


def test_an_op_that_gives_another_output_from_the_same_inputs_is_named():
    verify = [record(0, "short_conv", [1.0], [2.0]), record(1, "gqa_attention", [5.0], [3.0])]
    decode = [record(0, "short_conv", [1.0], [2.0]), record(1, "gqa_attention", [5.0 + 2 ** -20], [3.0])]
    found = first_parting(verify, 0, decode, 0)
    assert (found["layer"], found["op"], found["at"]) == (1, "gqa_attention", "output")


def test_rows_that_agree_everywhere_part_nowhere_and_other_ops_are_refused():
    ops = [record(0, "short_conv", [1.0], [2.0])]
    assert first_parting(ops, 0, ops, 0) is None
    with pytest.raises(ValueError, match="other ops"):
        first_parting(ops, 0, [record(0, "gdn_core", [1.0], [2.0])], 0)


def test_a_traced_twin_run_reports_each_rows_first_parting_op(tmp_path_factory):
    from runtime.step.bound_ops import BoundOps
    from runtime.graphs.runner import GraphRunner
    from runtime.cache.kv_pool import KVPool
    from runtime.artifact.loader import load_artifact
    from runtime.cache.state_pool import StatePool

    art, D = load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1]), 3
    kv = KVPool(art.registry, 4 * 3 + 1, 16)
    st = StatePool(art.registry, 4, draft_tokens=D, verify_rows=2)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(), extend_buckets=(),
                         max_pages_per_seq=3, extend_max_seqs=4)  # nothing captured: every step eager
    vocab = int(art.manifest["model"]["vocab_size"])
    plain, traced = (verify_against_decode(runner, vocab, [3, 18], D, torch.Generator().manual_seed(1), trace_ops=t)
                     for t in (False, True))
    assert [r["rel_err"] for r in traced["rows"]] == [r["rel_err"] for r in plain["rows"]]
    assert traced["keys"] == [None] * (D + 2) and ops.observer is None
    layers = {layer.layer_id for layer in art.registry.layers}
    for row in traced["rows"]:
        parting = row["parting"]
        assert (parting is None) == (row["rel_err"] == 0), row
        if parting is not None:
            assert parting["layer"] in layers and parting["op"] in OP_SPECS, row
            assert parting["at"] == "output" or parting["at"].split()[1] in OP_SPECS[parting["op"]].token_args, row
    assert st.num_free == st.num_slots and kv.num_free == kv.num_pages
