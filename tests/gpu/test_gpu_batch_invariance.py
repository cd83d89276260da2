"""Batch invariance on a CUDA GPU (`hgc compile --batch-invariant`) for every family, and with compiled pieces.

docs/DESIGN.md "Batch invariance" promises that a decode row is computed bit for bit as the
request's own decode step alone would compute it, whatever shares its step. Per build (a tiny
checkpoint, bf16, graphs captured and checked at start-up), testkit/batch_invariance_checks.py:

1. Twin requests a and b get the same history, each in an eager prefill of its own (one step
   shape: the same bits). Then, step after step, a decodes alone (the decode bucket of 1) and b
   decodes the same token among other requests of other lengths, at another row each step, with
   padding rows in every other step (the bucket of 8). a's and b's logits must be equal bit for
   bit. The histories (300 tokens and more) cross the fixed attention split of 256 keys.
2. For the families with an MTP layer, greedy tokens with D = 3 drafts are plain decoding's
   (tests/gpu/test_gpu_speculative.py runs D = 1, 3, 7 and a forced drafter for qwen3_next).

Builds: qwen3_next (GQA, GDN), qwen3_5 (GQA, GDN, its own MTP layout), bailing_linear (MLA,
Lightning) and kimi_linear (MLA, KDA, no MTP layer), each with the traced glue; and qwen3_next
with compiled pieces (`hgc compile` builds the Inductor bundle on this machine), compiled and run
in processes of their own: `python -m testkit.batch_invariance_checks` and `hgc run --json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
# head_dim 64: FlashInfer's prefill (GQA extends) builds no head dim 32, tiny's GQA layers have it
BUILDS = {"qwen3_next": ("qwen3_next", {"head_dim": 64}, False),
          "qwen3_5": ("qwen3_5", {"head_dim": 64}, False),
          "bailing_linear": ("bailing_linear", {}, False),
          "kimi_linear": ("kimi_linear", {}, False),
          "qwen3_next-compiled": ("qwen3_next", {"head_dim": 64}, True)}
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([1, 5, 17, 3, 9, 2, 12, 7])]
NEW_TOKENS = [9, 4, 14, 6, 11, 3, 8, 13]


def _python(*argv: str) -> str:
    """stdout of `python ARGV` in a process of its own (the kernel caches are the machine's, as for
    every process; the build points Inductor at a fresh folder itself)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request, tmp_path_factory):
    """(name, artifact folder, the artifact loaded here or None). A build with compiled pieces is
    compiled and run in processes of their own: its bundle must be loaded before anything imports
    FlashInfer (runtime/artifact/bundle.py), which the other builds' runs in this process have done. Loading
    an artifact here routes the process's CUDA matrix products and sums to the batch-invariant kernels, taken
    back afterwards for the other modules."""
    from hgc import main
    from runtime.backends import batch_invariant_aten
    from runtime.artifact.loader import load_artifact
    from testkit.helpers import tiny_checkpoint

    family, overrides, compiled = BUILDS[request.param]
    root = tmp_path_factory.mktemp(f"bi-{request.param}")
    tiny_checkpoint(family, root / "c", seed=2, **overrides)
    argv = ["compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--dtype", "bfloat16",
            "--batch-invariant", "--no-dumps"]
    if compiled:
        _python("-m", "hgc", *argv, "--inductor")
        yield request.param, root / "a", None
        return
    assert main(argv + ["--no-inductor"]) == 0
    art = load_artifact(root / "a", "cuda")
    assert art.batch_invariant and batch_invariant_aten.installed() and art.compiled is None
    yield request.param, root / "a", art
    batch_invariant_aten.uninstall()


def test_a_decode_row_is_the_same_bits_alone_and_among_others(build):
    from testkit.batch_invariance_checks import decode_alone_against_batched

    name, path, art = build
    if art is None:
        found = json.loads(_python("-m", "testkit.batch_invariance_checks", str(path)))
        assert found["compiled"] and found["batch_invariant"]
        keys = set(found["keys"])
    else:
        found = decode_alone_against_batched(art, steps=6, generator=torch.Generator().manual_seed(11))
        keys = {str(k) for k in found["keys"]}
    assert keys == {"decode[tokens=1, seqs=1]", "decode[tokens=8, seqs=8]"}, keys
    differing = [s for s in found["steps"] if not s["equal"]]
    assert not differing, f"{name}: {differing}"


def _greedy_in_process(art, D: int) -> tuple[list[list[int]], dict]:
    from runtime.engine.engine import SamplingParams
    from runtime.assembly import EngineOptions, engine_for_artifact

    # every request admitted in the first step (eight slots, a budget over the 56 prompt tokens)
    engine = engine_for_artifact(art, EngineOptions(slots=8, token_budget=64, speculative_tokens=D, page_size=16),
                                 64, device="cuda")
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, NEW_TOKENS)]
    results = engine.run_until_done()
    return [list(results[i].output_ids) for i in ids], engine.stats()


def _greedy_hgc_run(path: Path, D: int) -> tuple[list[list[int]], dict]:
    """`hgc run --json` of the artifact (compiled pieces, graphs), every prompt to the longest length asked."""
    prompts = ";".join(",".join(map(str, p)) for p in PROMPTS)
    flags = ["--speculative-tokens", str(D)] if D else []
    out = json.loads(_python("-m", "hgc", "run", str(path), "--prompt-ids", prompts,
                             "--max-new-tokens", str(max(NEW_TOKENS)), "--json", "--allow-kernel-builds", *flags))
    return [o["output_ids"] for o in out["outputs"]], out


def test_greedy_tokens_with_drafts_are_plain_decodings(build):
    name, path, art = build
    if art is None:
        (drafted, run), (plain, _) = _greedy_hgc_run(path, 3), _greedy_hgc_run(path, 0)
        assert drafted == plain, name
        assert run["timing"]["speculative"]["verify_steps"] > 0 and run["steps"]["graph_replays"] > 0, run
        return
    if "draft" not in art.docs.programs:
        pytest.skip(f"{name}: no MTP layer")
    plain, _ = _greedy_in_process(art, 0)
    drafted, stats = _greedy_in_process(art, 3)
    assert drafted == plain, name
    assert stats["spec_verify_steps"] > 0
    assert stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"], stats
