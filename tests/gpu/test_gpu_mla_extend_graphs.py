"""Whole-step extend graphs of the MLA families on a CUDA GPU: linear attention and MLA captured in
short extend buckets.

Runs only on the GPU machine (`pytest -m gpu`). Kimi-Linear's extend gaps are KDA (triton_linear:
the recurrent extend kernel over the bucket's static tables up to `short_extend_tokens`, FLA's chunk
kernels above) and MLA (the Triton MLA kernel's varlen form from the page table, lengths and query
offsets up to `whole_extend_tokens`); the default cuda compile records the smaller bound (64) as its
extend plans' `whole_up_to`. Bailing (Ling / Ring linear) has Lightning, whose chunk kernels are
captured at every size, beside MLA: its bound is MLA's (512). The extend buckets up to the bound are
whole-step graphs, the larger ones pieces. What the CPU tests cannot reach: the kernels and both
backends' replay state recorded inside a real whole-step graph and replayed for steps of other
lengths and request counts, in the full-row and the one-request keys of a bucket.

Tiny models in float32 (MLA on triton_mla: FlashInfer has no float32): start-up parity passes for
both kinds of extend graph, short prompts (one, three at once) replay whole graphs and a prompt
above the bound runs pieces, every step's tokens those of the same runner's eager steps; and `hgc
run` with graphs gives the greedy tokens of `--no-graphs`.
"""

from __future__ import annotations

import json

import pytest
import torch

from compiler.splitops import Mode
from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.engine.generate import make_pools
from runtime.graphs.buckets import SOLO_EXTEND_TOKENS
from runtime.graphs.runner import GraphRunner
from runtime.graphs.startup_parity import check_parity
from runtime.step.bound_ops import BoundOps
from testkit.graph_cases import greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# family: (the default compile's whole_up_to, extend buckets: whole up to the bound, one bucket of pieces)
FAMILIES = {"kimi_linear": (64, (16, 64, 128)), "bailing_linear": (512, (16, 64, 512, 1024))}
PAGE = 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def artifact(request, tmp_path_factory):
    """The tiny model of the family, float32, compiled for cuda with the default routes."""
    from testkit.helpers import tiny_checkpoint

    family = request.param
    root = tmp_path_factory.mktemp(f"g{family}")
    tiny_checkpoint(family, root / "c")
    assert main(["compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--no-inductor",
                 "--dtype", "float32", "--no-dumps"]) == 0
    split = json.loads((root / "a" / "split.json").read_text())["programs"]["main"]
    assert {split[m]["whole_up_to"] for m in ("extend", "mixed")} == {FAMILIES[family][0]}, split["extend"]["whole_why"]
    return family, load_artifact(root / "a", "cuda")


def make_runner(art, buckets):
    longest = buckets[-1]
    kv, st = make_pools(art.registry, longest, 8, page_size=PAGE, device="cuda", kv_dtype=torch.float32)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cuda", decode_buckets=(1, 2, 4), extend_buckets=buckets,
                         max_pages_per_seq=longest // PAGE, extend_max_seqs=4, debug=True)
    return runner, st


def test_short_extends_replay_whole_step_graphs_with_the_eager_tokens(artifact):
    family, art = artifact
    bound, buckets = FAMILIES[family]
    runner, st = make_runner(art, buckets)
    assert sorted({k.tokens for k in runner.whole_keys if k.mode == Mode.EXTEND}) == [b for b in buckets if b <= bound]
    above = buckets[-2] + 20  # the largest bucket's: pieces
    batches = [[[(7 * j) % 200 + 3 for j in range(12)]],  # one short prompt: the 16 bucket's one-request key
               [list(range(2, 12)), list(range(40, 47)), [9] * 13],  # three at once: 30 tokens, the 64 bucket's full key
               [[(5 * j) % 150 + 2 for j in range(60)]],  # one request of 60 tokens: the 64 bucket's one-request key
               [[(3 * j) % 190 + 4 for j in range(above)]]]  # above the bound: pieces, linear attention in the gap
    eager = [greedy(runner, st, prompts, 6)[0] for prompts in batches]
    runner.capture()
    report = check_parity(runner, vocab_size=256)
    assert max(report.values()) < 1e-3, report
    for prompts, want in zip(batches, eager):
        before = dict(runner.counters)
        got, keys = greedy(runner, st, prompts, 6)
        whole = keys[0].tokens <= bound
        alone = len(prompts) == 1 and keys[0].tokens <= SOLO_EXTEND_TOKENS  # the bucket's one-request key
        assert keys[0].mode == Mode.EXTEND and keys[0].seqs == (1 if alone else 4), keys
        assert (keys[0] in runner.whole_keys) == whole, keys
        assert runner.counters["piecewise_steps"] - before["piecewise_steps"] == (0 if whole else 1), keys
        assert got == want, (sum(map(len, prompts)), got, want)


def test_hgc_run_with_graphs_gives_the_no_graphs_tokens(artifact, capsys):
    """Prompts of 5 to 70 tokens, several at once (mixed steps as they finish apart): the engine
    on captured graphs against the same engine with every step eager, float32: the same tokens."""
    _, art = artifact
    path = str(art.docs.path)
    prompts = [[(11 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 32, 17, 70))]
    ids = ";".join(",".join(map(str, p)) for p in prompts)
    outs = {}
    for flags in ((), ("--no-graphs",)):
        assert main(["run", path, "--device", "cuda", "--prompt-ids", ids, "--max-new-tokens", "8", "--json",
                     *flags]) == 0
        outs[flags] = json.loads(capsys.readouterr().out)
    assert outs[()]["steps"]["graph_replays"] > 0
    assert [o["output_ids"] for o in outs[()]["outputs"]] == [o["output_ids"] for o in outs[("--no-graphs",)]["outputs"]]
