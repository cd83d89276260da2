"""Compiled pieces on a CUDA GPU: `hgc compile --target cuda` builds the bundle by default, a run from empty
kernel caches compiles, builds and tunes nothing, graph replay gives the eager tokens, compiled glue gives
the traced glue's tokens, a second build gives the same code, its Triton kernels and FlashInfer modules all
from the first's.

Runs only on the GPU machine (`pytest -m gpu`); benchmarks/serving/startup_bench.py measures start-up and
decode. Each `hgc` runs in a process of its own with empty kernel caches (Inductor's, Triton's,
FlashInfer's), so nothing but the artifact can supply a kernel. Three tiny builds: qwen3_next
(FlashInfer attention) and bailing_linear (its tiny MLA geometry on the Triton MLA kernel) in
bfloat16, kimi_linear in float32 (MLA on the Triton kernel; TF32 off, torch's default), where
compiled and traced glue must give the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler.splitops.bundle import BUNDLE, TARGETS
from runtime.graphs.parity import PARITY_RTOL
from testkit.helpers import ROOT, tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = "1,2,3,4,5,6,7;9,10,11;12,13,14,15,16"


def hgc(*argv: str, caches, home, check: bool = True) -> subprocess.CompletedProcess:
    caches.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HGC_HOME=str(home), **{v: str(caches / v.lower()) for v in
                                      ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")})
    proc = subprocess.run([sys.executable, "-m", "hgc", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


BUILDS = [("qwen3_next", "bfloat16"), ("bailing_linear", "bfloat16"), ("kimi_linear", "float32")]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=BUILDS, ids=[f"{f}-{d}" for f, d in BUILDS])
def built(request, tmp_path_factory):
    family, dtype = request.param
    root = tmp_path_factory.mktemp(f"gpu-inductor-{family}")
    # head_dim 64: FlashInfer builds no head dim 32 (tiny's GQA layers); float32 Kimi routes MLA to the Triton kernel
    tiny_checkpoint(family, root / "c", seed=1, **({"head_dim": 64} if family == "qwen3_next" else {}))
    # no --inductor: on a cuda machine the bundle is the default. GQA decode and extends of up to
    # whole_extend_tokens (512, which a lint wants as a bucket) run the Triton kernels, so qwen3_next's
    # 1024 bucket is the step that runs FlashInfer's prefill kernel, whose module the bundle must carry.
    extends = "64,512,1024" if family == "qwen3_next" else "64"
    proc = hgc("compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--dtype", dtype,
               "--decode-buckets", "1,2,4", "--extend-buckets", extends, "--no-dumps", caches=root / "build-caches",
               home=root / "home")
    return {"root": root, "art": root / "a", "home": root / "home", "family": family, "dtype": dtype,
            "extends": extends, "log": proc.stderr}


def run_json(built, name: str, *flags) -> dict:
    proc = hgc("run", str(built["art"]), "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json",
               *flags, caches=built["root"] / f"caches-{name}", home=built["home"])
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def runs(built) -> dict:
    """`hgc run` of the built artifact, each in a fresh process with empty kernel caches: compiled pieces
    with graphs (the default), compiled pieces every step eager, traced glue with graphs. The build's
    folder is gone first, as the next build of the target leaves it: Triton's group files name their
    kernels' files there, and the copy a run loads must not depend on it (runtime/artifact/bundle.py
    `_relocated_group`)."""
    for folder in (built["home"] / "build").iterdir():  # the seed beside it stays, for the rebuild below
        if folder.is_dir() and not folder.name.endswith(".seed"):
            shutil.rmtree(folder)
    # builds allowed, so every kernel the bundle lacks is listed in the report (the test below refuses any)
    return {"compiled": run_json(built, "compiled", "--allow-kernel-builds"),
            "compiled_eager": run_json(built, "compiled-eager", "--no-graphs", "--allow-kernel-builds"),
            "traced": run_json(built, "traced", "--no-compiled")}


def _lacking(built, names: list[str]) -> list[str]:
    """Each kernel built at start-up, and whether the bundle holds a file of that name in another folder
    (a different cache key) or none at all (never built by the build)."""
    key = next(iter(json.loads((built["art"] / "manifest.json").read_text())["targets"]))
    held = {f.rsplit("/", 1)[-1] for f in json.loads((built["art"] / TARGETS / key / BUNDLE).read_text())["files"]}
    return [f"{n} ({'same name, other folder' if n.rsplit('/', 1)[-1] in held else 'not built'})" for n in names]


def tokens(run: dict) -> list[list[int]]:
    return [o["output_ids"] for o in run["outputs"]]


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for p, q in zip(a, b) for x, y in zip(p, q))


def test_compile_with_inductor_builds_the_bundle_on_cuda(built):
    manifest = json.loads((built["art"] / "manifest.json").read_text())
    (key,) = manifest["targets"]
    assert key.startswith("sm") and f"building {key}" in built["log"] and "compiled in" in built["log"]
    doc = json.loads((built["art"] / TARGETS / key / BUNDLE).read_text())
    caches = {f.split("/")[1] for f in doc["files"] if f.startswith("kernels/")}
    # FlashInfer's modules where a step runs FlashInfer's kernel: qwen3_next's 1024-token bucket (the
    # tiny MLA geometry goes to Triton's kernel)
    routed = {e["backend"] for p in json.loads((built["art"] / "routing.json").read_text())["programs"].values()
              for e in p}
    fi = built["family"] == "qwen3_next"
    assert fi <= ("flashinfer" in routed) and {"triton", *(["flashinfer"] if fi else [])} <= caches, (caches, routed)
    assert doc["pieces"] and all(s["piece"] in doc["pieces"] for s in doc["programs"]["main"] if s["outputs"])
    # a cuda bundle's projections call the GEMV op (compiler/splitops/glue_ops.py; tiny shapes are in no
    # CONFIGS entry, so its kernel runs F.linear here: tests/gpu/test_gpu_glue_gemv.py runs the GEMV)
    assert doc["small_m_linear"] is True and "glue projections: calls of hgc_glue::small_m_linear" in built["log"]
    assert sum(doc["pieces"][s["piece"]]["small_m_linear"] for s in doc["programs"]["main"] if s["piece"]) > 0
    # the build's start-up captured and checked every bucket with the fresh pieces, after a step of
    # the largest extend bucket on which Inductor's kernels chose their launch configurations
    assert doc["parity"] and all(p["worst_op_rel_err"] <= p["rtol"] for p in doc["parity"])
    assert f"tuning step: extend[tokens={max(int(t) for t in built['extends'].split(','))}" in built["log"]


def test_a_run_from_empty_caches_compiles_nothing_and_matches_the_traced_glue(built, runs):
    rtol = PARITY_RTOL[getattr(torch, built["dtype"])]
    for name in ("compiled", "compiled_eager"):
        report = runs[name]["compiled"]
        assert report["pieces"] >= 1 and report["inductor_compiles"] == 0, (name, report)
        assert report["parity"] and all(p["worst_op_rel_err"] <= rtol and p["logits_rel_err"] <= rtol
                                        for p in report["parity"]), (name, report["parity"])
        if built["dtype"] == "float32":  # compiled glue differs from traced by rounding only
            assert all(p["logits_rel_err"] <= 1e-5 for p in report["parity"]), (name, report["parity"])
    assert "compiled" not in runs["traced"]


def test_a_run_from_empty_caches_builds_no_kernel(built, runs):
    # hgc run of short prompts starts under other limits than the build (3 slots, max_seq_len 15, the
    # prefix cache on): it once built a _short_conv_extend_kernel and a _chunk_state_kernel variant the
    # bundle lacked (benchmarks/results/gpu_tests_inductor_qwen3_next_h200_2026-12-04.log): both take
    # tables of the staging block, which sat at 8-byte offsets in some keys (16-byte aligned since);
    # tests/runtime/graphs/test_start_up_specializations.py checks the same promise on the CPU
    for name in ("compiled", "compiled_eager"):
        report = runs[name]["compiled"]
        assert report["kernel_builds"] == 0, (name, _lacking(built, report["built"]))
    # the process's own kernel caches stayed empty: the bundle's copy is all it loaded from
    for name in ("compiled", "compiled-eager"):
        built_here = [p for p in (built["root"] / f"caches-{name}").rglob("*") if p.is_file()
                      and (p.suffix in (".so", ".cubin", ".best_config") or p.name.startswith("__grp__"))]
        assert not built_here, f"{name}: kernels built into the process's caches: {built_here[:3]}"


def test_graph_replay_gives_the_eager_tokens(built, runs):
    graphs, eager = runs["compiled"], runs["compiled_eager"]
    assert graphs["steps"]["graph_replays"] > 0 and "steps" not in eager
    got, want = tokens(graphs), tokens(eager)
    if built["dtype"] == "float32":
        assert got == want
    else:  # bf16 kernels on padded shapes may part late at a near tie of a random tiny model, never at once
        assert [g[0] for g in got] == [w[0] for w in want]
        assert differing(got, want) <= len(got) * NEW_TOKENS // 4, (got, want)


def test_compiled_pieces_give_the_tokens_of_the_traced_glue(built, runs):
    got, want = tokens(runs["compiled"]), tokens(runs["traced"])
    if built["dtype"] == "float32":  # TF32 off: greedy tokens identical
        assert got == want
    else:  # bf16: Inductor rounds a fused chain once; the first token of each prompt must agree
        # (benchmarks/serving/startup_bench.py counts the rest on the bench model)
        assert [g[0] for g in got] == [w[0] for w in want], (got, want)


def test_a_second_build_gives_the_same_code(built):
    key = next(iter(json.loads((built["art"] / "manifest.json").read_text())["targets"]))
    first = json.loads((built["art"] / TARGETS / key / BUNDLE).read_text())
    proc = hgc("build", str(built["art"]), "--device", "cuda", "--force", caches=built["root"] / "rebuild-caches",
               home=built["home"])
    second = json.loads((built["art"] / TARGETS / key / BUNDLE).read_text())
    # every Triton kernel the rebuild asked for came from the first build's seed (hgc/kernel_seed.py):
    # the same code under the same fixed build folder has the same keys
    reused = re.search(r"Triton kernels: (\d+) of (\d+) from earlier builds", proc.stderr)
    assert reused and reused[1] == reused[2] != "0", proc.stderr[-2000:]
    # and so did every FlashInfer module it loaded (hgc/flashinfer_seed.py): none built again, and the
    # bundle holds the same modules as the first build's (a module loaded from the seed is the bundle's too)
    def modules_of(doc):
        return sorted(Path(f).name for f in doc["files"] if "/flashinfer/" in f and f.endswith(".so"))
    modules = re.search(r"FlashInfer modules: (\d+) of (\d+) from earlier builds", proc.stderr)
    assert modules_of(second) == modules_of(first)
    assert modules and modules[1] == modules[2] == str(len(modules_of(first))), proc.stderr[-2000:]
    assert {p: v["code_sha256"] for p, v in first["pieces"].items()} == \
           {p: v["code_sha256"] for p, v in second["pieces"].items()}
    differ = sorted(f for f in set(first["files"]) | set(second["files"])
                    if first["files"].get(f) != second["files"].get(f))
    # a file that only one of the builds holds is explained where that build's bundle.json says why
    unexplained = [f for f in differ if f not in second["not_reproducible"] and f not in first["not_reproducible"]]
    assert not unexplained, f"files a rebuild changed without bundle.json saying why: {unexplained[:5]}"
