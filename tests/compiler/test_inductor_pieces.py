"""Compiled pieces on the CPU target: `hgc compile --target cpu --inductor` builds a target bundle, `hgc run`
runs it with the tokens of `hgc generate` and builds nothing at start-up, and every refusal of
executable content holds: a flipped byte, another installation's key, another torch build, a
kernel the bundle lacks, a piece that computes something else than the traced glue.

One build for the module (a 2-layer Qwen3-Next: a GDN layer and a gated GQA layer, dense MLPs), in
a subprocess like a user's; each refusal works on a copy of the artifact, edited the
way a different build would have written it (re-hashed and re-signed), so only the check under
test can catch it. One glue segment of a Ling model (bailing_linear) is compiled alone: it reads
a size taken before an op core, which no qwen3_next segment does.
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

from hgc import main
from compiler.splitops import Mode
from compiler.splitops.artifact import MANIFEST, dump_json, seal_manifest, sha256_file
from compiler.splitops.bundle import BUNDLE, TARGETS, signed_payload, target_facts, target_key
from runtime.artifact.bundle import BundleError, CompiledOptions
from runtime.artifact.loader import LoadError, load_artifact
from runtime.graphs.parity import PARITY_RTOL, ParityError
from runtime.artifact.signing import sign, signing_key
from testkit.helpers import ROOT, shared_artifact, tiny_checkpoint
from testkit.traced_glue import stand_in_inductor

pytestmark = [pytest.mark.slow,  # an Inductor build (C++ compiles) and two `hgc run` processes: about 90 s on 2 cores
              pytest.mark.usefixtures("shared_loads")]

PROMPTS = "1,2,3,4,5,6,7;9,10,11"
NEW_TOKENS = 5
# Inductor's own choice of the CPU's vector ISA (its probe builds, which a bundle carries), where the
# rest of the suite takes the CPU's flags' answer (tests/conftest.py): empty reads as unset.
PROBE_CPU_ISA = {"TORCHINDUCTOR_VEC_ISA_OK": ""}


def hgc(*argv: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`hgc ...` in a process of its own (nothing in this process's memory helps it)."""
    # One intra-op thread: a tiny model gains nothing from more, and on a busy 2-core machine their
    # spinning costs a decode step 10x its time.
    # PROBE_CPU_ISA: the module's `hgc` processes probe the vector ISA, as a user's do.
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", **PROBE_CPU_ISA, **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "hgc", *argv], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("inductor")
    home = root / "home"
    before = os.environ.get("HGC_HOME")
    os.environ["HGC_HOME"] = str(home)  # this installation: its signing key and build folders live here
    try:
        tiny_checkpoint("qwen3_next", root / "ckpt", num_hidden_layers=2, full_attention_interval=2,
                        num_nextn_predict_layers=0, mlp_only_layers=[0, 1])
        proc = hgc("compile", str(root / "ckpt"), "-o", str(root / "art"), "--target", "cpu", "--inductor",
                   "--no-dumps")
        yield {"root": root, "home": home, "art": root / "art", "ckpt": root / "ckpt", "log": proc.stderr,
               "key": target_key(target_facts("cpu"))}
    finally:
        if before is None:
            os.environ.pop("HGC_HOME", None)
        else:
            os.environ["HGC_HOME"] = before


@pytest.fixture(scope="module")
def eager(built, one_thread):
    return in_process("generate", str(built["ckpt"]))["outputs"]


def in_process(*argv) -> dict:
    """`hgc run` or `hgc generate` of the module's prompts in this process, its JSON."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    return json.loads(out.getvalue())


def run_json(art, *flags, env=None) -> dict:
    proc = hgc("run", str(art), "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json", *flags, env=env)
    return json.loads(proc.stdout)


def copy_of(built, name: str) -> Path:
    dest = built["root"] / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(built["art"], dest)
    return dest


def rewrite_bundle(art: Path, key: str, edit) -> str:
    """Edit a bundle as another build would have written it: `edit(doc, folder)` changes bundle.json
    (and files); the files are re-hashed, bundle.json re-signed with this installation's key, and the
    manifest re-listed. Returns the bundle's (possibly new) key."""
    folder = art / TARGETS / key
    doc = json.loads((folder / BUNDLE).read_text())
    edit(doc, folder)
    new_key = doc["target"]
    if new_key != key:
        folder = folder.rename(art / TARGETS / new_key)
    doc["files"] = {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
                    if p.is_file() and p.name != BUNDLE}
    doc["signature"] = sign(signed_payload(doc), signing_key())
    (folder / BUNDLE).write_bytes(dump_json(doc))
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["files"] = {n: s for n, s in manifest["files"].items() if not n.startswith(f"{TARGETS}/")}
    manifest["files"].update({p.relative_to(art).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
                              if p.is_file()})
    manifest["targets"] = {new_key: {"bundle": f"{TARGETS}/{new_key}/{BUNDLE}", "facts": doc["facts"]}}
    (art / MANIFEST).write_bytes(dump_json(seal_manifest(manifest)))  # as the other build's compiler sealed it
    return new_key


def test_compile_builds_a_signed_bundle_listed_in_the_manifest(built):
    art, key = built["art"], built["key"]
    assert f"building {key}" in built["log"] and "compiled in" in built["log"], built["log"]
    manifest = json.loads((art / MANIFEST).read_text())
    doc = json.loads((art / TARGETS / key / BUNDLE).read_text())
    assert manifest["targets"][key]["bundle"] == f"{TARGETS}/{key}/{BUNDLE}"
    listed = {n for n in manifest["files"] if n.startswith(f"{TARGETS}/{key}/")}
    on_disk = {p.relative_to(art).as_posix() for p in (art / TARGETS / key).rglob("*") if p.is_file()}
    assert listed == on_disk, "every bundle file is hashed in the manifest"
    assert {f"{TARGETS}/{key}/{f}" for f in doc["files"]} == on_disk - {f"{TARGETS}/{key}/{BUNDLE}"}
    pieces = [f for f in doc["files"] if f.startswith("pieces/")]
    assert pieces and all(doc["not_reproducible"][f] for f in pieces), "the manifest says what a rebuild changes"
    assert any(f.endswith(".so") for f in doc["files"]), "the C++ kernels the pieces load travel with them"
    segments = doc["programs"]["main"]
    assert len(pieces) <= len(segments) and all(s["piece"] in doc["pieces"] for s in segments if s["outputs"])
    assert doc["facts"]["torch"] == torch.__version__ and doc["signature"]["hmac_sha256"]
    assert doc["small_m_linear"] is False and all(p["small_m_linear"] == 0 for p in doc["pieces"].values())
    assert (built["home"] / "signing.key").stat().st_mode & 0o777 == 0o600


def test_compiled_run_gives_the_tokens_of_generate_and_builds_nothing(built, eager):
    ran = in_process("run", str(built["art"]))
    assert ran["outputs"] == eager
    report = ran["compiled"]
    assert report["target"] == built["key"] and report["pieces"] >= 1
    assert report["kernel_builds"] == 0 and report["inductor_compiles"] == 0
    assert [p["step"] for p in report["parity"]] == ["extend", "decode"]
    assert all(p["worst_op_rel_err"] <= PARITY_RTOL[torch.float32] for p in report["parity"])


def test_a_second_run_with_empty_caches_loads_the_pieces_without_compiling(built, eager, tmp_path):
    shutil.rmtree(built["home"] / "build", ignore_errors=True)  # the build's caches: gone
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    ran = run_json(built["art"], env=caches)
    assert ran["outputs"] == eager
    assert ran["compiled"]["kernel_builds"] == 0 and ran["compiled"]["inductor_compiles"] == 0
    assert not list(tmp_path.rglob("*.so")), "nothing was built into the process's own caches"
    plain = in_process("run", str(built["art"]), "--no-compiled")
    assert plain["outputs"] == eager and "compiled" not in plain


def test_a_load_of_some_programs_opens_only_the_pieces_their_glue_names(built):
    """open_bundle(programs=...) (a run without drafts loads "main" alone): a piece that only another
    program's glue names is not opened (here one bundle.json lists no file for), while a load of
    every program looks it up."""
    from runtime.artifact.bundle import _load_pieces

    base = built["art"] / TARGETS / built["key"]
    doc = json.loads((base / BUNDLE).read_text())
    main_pieces = {r["piece"] for r in doc["programs"]["main"]}
    doc["programs"]["main"].append({"piece": None})  # a segment left traced names no piece
    doc["programs"]["other"] = [{"piece": "pieces/not_there.bin"}]
    doc["pieces"] = {**doc["pieces"], "pieces/not_there.bin": {}}
    assert set(_load_pieces(base, doc, programs=("main",))) == main_pieces
    with pytest.raises(KeyError, match="not_there.bin"):
        _load_pieces(base, doc)


def test_inspect_lists_the_bundle(built, capsys):
    assert main(["inspect", str(built["art"])]) == 0
    out = capsys.readouterr().out
    assert f"{TARGETS}/{built['key']}" in out and torch.__version__ in out
    assert main(["inspect", str(built["art"]), "--json"]) == 0
    bundles = json.loads(capsys.readouterr().out)["bundles"]
    assert [b["bundle"] for b in bundles] == [f"{TARGETS}/{built['key']}"] and bundles[0]["pieces"] >= 1
    assert bundles[0]["GEMV projections"] == "off", "a cpu bundle's projections stay aten's linear"
    assert bundles[0]["folded norms"] == "off", "a cpu bundle folds no norm into a projection"
    assert bundles[0]["q/k norm+rope calls"] == "off", "a cpu bundle keeps Inductor's code for the q / k norms"
    assert bundles[0]["PDL"] == "off", "a cpu bundle launches nothing with programmatic dependent launch"


@pytest.mark.parametrize("what", ["pieces/", "kernels/"])
def test_a_flipped_byte_in_the_bundle_is_refused(built, what):
    art = copy_of(built, "flipped")
    folder = art / TARGETS / built["key"]
    victim = next(p for p in sorted(folder.rglob("*")) if p.relative_to(folder).as_posix().startswith(what)
                  and p.suffix in (".bin", ".so"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=f"{victim.name}.*does not match manifest.json"):
        load_artifact(art)


def test_another_installation_is_refused_without_the_trust_flag_and_runs_with_it(built, eager, monkeypatch, capsys):
    other = built["root"] / "other-home"
    monkeypatch.setenv("HGC_HOME", str(other))
    with pytest.raises(BundleError, match="has no signing key.*--trust-compiled.*hgc build"):
        load_artifact(built["art"])
    signing_key(create=True)  # the other installation builds something once: it has a key of its own now
    with pytest.raises(BundleError, match=r"executable code \(kernels/inductor/.*pieces/.*another installation's key"):
        load_artifact(built["art"])
    # a bundle the user has not consented to is refused input: exit 2, as every refused artifact
    assert main(["run", str(built["art"]), "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS)]) == 2
    assert "--trust-compiled" in capsys.readouterr().err
    ran = in_process("run", str(built["art"]), "--trust-compiled")
    assert ran["outputs"] == eager and ran["compiled"]["target"] == built["key"]


def test_a_bundle_for_another_torch_build_is_refused_naming_both(built):
    art = copy_of(built, "other-torch")

    def older(doc, folder):
        doc["facts"]["torch"] = "2.12.0+cpu"
        doc["target"] = target_key(doc["facts"])

    old_key = rewrite_bundle(art, built["key"], older)
    assert old_key != built["key"] and "torch2.12.0" in old_key
    with pytest.raises(BundleError, match=rf"built for {old_key} \(torch 2.12.0\+cpu.*this installation is "
                                          rf"{built['key']} \(torch {re.escape(torch.__version__)}.*hgc build {art} "
                                          rf"--device cpu"):
        load_artifact(art)
    assert load_artifact(art, compiled=CompiledOptions(enabled=False)).compiled is None  # the portable part loads


def test_a_bundle_of_another_build_of_this_torch_release_is_refused(built):
    art = copy_of(built, "other-build")
    rewrite_bundle(art, built["key"], lambda doc, folder: doc["facts"].update(torch_git="0" * 40))
    with pytest.raises(BundleError, match=r"torch_git: bundle '0000.*here '.*rebuild it here with `hgc build"):
        load_artifact(art)


def test_a_kernel_missing_from_the_bundle_is_an_error_naming_it(built):
    art = copy_of(built, "missing")
    folder = art / TARGETS / built["key"]
    victim = next(p for p in sorted((folder / "kernels").rglob("*.main.so")))
    rewrite_bundle(art, built["key"], lambda doc, f: victim.unlink())
    proc = hgc("run", str(art), "--prompt-ids", PROMPTS, "--max-new-tokens", "1", check=False)
    assert proc.returncode == 2  # an incomplete bundle is a refused artifact
    assert f"kernel {victim.name} is not in the bundle" in proc.stderr and "--allow-kernel-builds" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_triton_group_names_the_private_copy_not_the_build_folder(built, monkeypatch, tmp_path):
    """Triton's group file lists a kernel's files by absolute path, the build folder's, which the next
    build of the target empties. Materialized, the group names the copy's files, so Triton's own
    lookup finds the kernel there (not built again at start-up) with the build folder gone, and reads
    the checked copy. A group file that is not one is refused, naming it."""
    from triton.runtime.cache import FileCacheManager

    from runtime.artifact.bundle import _materialize
    from runtime.artifact.docs import read_artifact

    art, key = copy_of(built, "groups"), built["key"]
    gone = tmp_path / "build" / "triton" / "KEY"  # the build's folder: never created here
    children = {"k.cubin": b"cubin bytes", "k.json": b'{"name": "k"}'}

    def add_kernel(doc, folder, group: bytes):
        kernel = folder / "kernels" / "triton" / "KEY"
        kernel.mkdir(parents=True, exist_ok=True)
        for name, data in children.items():
            (kernel / name).write_bytes(data)
        (kernel / "__grp__k.json").write_bytes(group)

    group = json.dumps({"child_paths": {n: str(gone / n) for n in children}}).encode()
    rewrite_bundle(art, key, lambda doc, folder: add_kernel(doc, folder, group))
    docs = read_artifact(art)
    doc = json.loads((art / TARGETS / key / BUNDLE).read_text())
    caches = _materialize(docs, key, doc, 0)
    copy = caches["triton"] / "KEY"
    assert json.loads((copy / "__grp__k.json").read_text()) == {"child_paths": {n: str(copy / n) for n in children}}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(caches["triton"]))
    found = FileCacheManager("KEY").get_group("k.json")
    assert found == {n: str(copy / n) for n in children} and all(Path(p).read_bytes() == children[n]
                                                                  for n, p in found.items())

    rewrite_bundle(art, key, lambda doc, folder: add_kernel(doc, folder, b'{"paths": []}'))
    docs = read_artifact(art)
    doc = json.loads((art / TARGETS / key / BUNDLE).read_text())
    with pytest.raises(BundleError, match=r"kernels/triton/KEY/__grp__k.json: not a Triton cache group file"):
        _materialize(docs, key, doc, 0)


def test_the_kernel_watch_tells_a_rewrite_of_the_same_bytes_from_a_build(tmp_path):
    """Loading a piece writes its recorded tuning choices again (the same bytes): no build. A choice
    whose bytes change, or a new kernel file, is a build, refused by name."""
    from runtime.artifact.bundle import KernelBuildError, KernelWatch

    folders = {name: tmp_path / name for name in ("inductor", "triton", "flashinfer")}
    for folder in folders.values():
        folder.mkdir()
    choice = folders["inductor"] / "3b" / "abc.best_config"
    choice.parent.mkdir()
    choice.write_text('{"XBLOCK": 64}')
    with KernelWatch(folders, allow=False, remedy="rebuild it") as watch:
        choice.write_text('{"XBLOCK": 64}')
    assert watch.builds == []
    with pytest.raises(KernelBuildError, match=r"inductor/3b/abc.best_config of the bundle was rebuilt or tuned"):
        with KernelWatch(folders, allow=False, remedy="rebuild it"):
            choice.write_text('{"XBLOCK": 128}')
    with pytest.raises(KernelBuildError, match=r"triton/k/__grp__k.json is not in the bundle"):
        with KernelWatch(folders, allow=False, remedy="rebuild it"):
            (folders["triton"] / "k").mkdir()
            (folders["triton"] / "k" / "__grp__k.json").write_text("{}")


def test_the_serving_watch_names_each_triton_kernel_built_after_start_up_once(tmp_path):
    """After start-up a kernel Triton builds (a folder of its own in its cache) is a warning naming it
    with the remedy, counted once; a folder there before the watch began is not."""
    from runtime.artifact.bundle import ServingWatch

    triton = tmp_path / "triton"
    (triton / "OLD").mkdir(parents=True)
    lines = []
    watch = ServingWatch(triton, "rebuild it with hgc build", lines.append, interval_s=0.0)
    watch.check()
    assert lines == [] and watch.builds == []
    (triton / "NEW").mkdir()
    for name in ("_align_kernel.json", "__grp___align_kernel.json", "_align_kernel.cubin"):
        (triton / "NEW" / name).write_text("{}")
    watch.check()
    watch.check()
    assert watch.builds == ["triton/NEW"]
    assert len(lines) == 1 and "_align_kernel.json while serving" in lines[0] and "rebuild it with hgc build" in lines[0]
    slow = ServingWatch(triton, "rebuild", lines.append, interval_s=3600.0)
    (triton / "LATER").mkdir()
    slow.check()
    assert slow.builds == [], "looked at most once per interval"


def test_engine_stats_count_kernels_the_serving_watch_saw(tmp_path):
    from runtime.artifact.bundle import ServingWatch
    from runtime.engine.sampling import SamplingParams
    from testkit.engine_toy import build_model, make_engine, prompts

    assert "kernels_built_serving" not in make_engine(build_model("toy")).stats()
    triton = tmp_path / "triton"
    triton.mkdir()
    engine = make_engine(build_model("toy"), kernel_watch=ServingWatch(triton, "rebuild", lambda line: None,
                                                                       interval_s=0.0))
    (triton / "K").mkdir()
    engine.generate(prompts(1, [5], 96)[0], SamplingParams(max_new_tokens=2))
    assert engine.stats()["kernels_built_serving"] == 1


def _perturbed(art):
    """The piece of the program's first glue segment, off by 1% in every output: a compiled piece that
    is not the traced glue (the inputs of layer 0's first op come out of it)."""
    name = art.compiled.doc["programs"]["main"][0]["piece"]
    piece = art.compiled.pieces[name]

    def off(t):
        # in the strides the piece gives (a slice of a projection GEMM is row-strided): the pieces
        # after it were compiled for them
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t * 1.01)

    def wrong(*inputs):
        return [off(t) if t.is_floating_point() else t for t in piece(*inputs)]

    art.compiled.pieces[name] = wrong


def test_start_up_parity_refuses_a_piece_that_differs_from_the_traced_glue(built):
    from runtime.assembly import EngineOptions, engine_for_artifact

    art = load_artifact(built["art"])
    engine = engine_for_artifact(art, EngineOptions(slots=2, token_budget=64), 64)
    assert engine.runner.forward.runner.glue is not None and art.compiled.parity
    art = load_artifact(built["art"])
    _perturbed(art)
    with pytest.raises(ParityError, match=r"compiled pieces against the traced glue .*layer 0 \(\w+\) hands it "
                                          r"inputs with rel err"):
        engine_for_artifact(art, EngineOptions(slots=2, token_budget=64), 64)


def test_graph_runner_replays_compiled_pieces_checked_against_the_traced_glue(built, eager):
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.step.bound_ops import BoundOps
    from runtime.artifact.compiled_glue import compiled_calls
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from testkit.graph_cases import RerunGraphs, greedy

    art = load_artifact(built["art"])
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    program = art.runner(ops)
    assert compiled_calls(program.module_for(Mode.EXTEND)) >= 1 and compiled_calls(
        program.module_for(Mode.EXTEND, compiled=False)) == 0
    runner = GraphRunner(program, ops, kv, st, "cpu", decode_buckets=(1, 2), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=4, graphs=RerunGraphs())
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert set(runner.parity.compiled) == {str(k) for k in runner.keys}
    for report in runner.parity.compiled.values():
        assert report["ops"] and report["worst_op"] <= PARITY_RTOL[torch.float32]
    tokens, keys = greedy(runner, st, [e["prompt_ids"] for e in eager], NEW_TOKENS)
    assert tokens == [e["output_ids"] for e in eager] and any(k is not None for k in keys)


def test_the_design_states_the_parity_tolerance_of_every_dtype():
    """docs/DESIGN.md's table is PARITY_RTOL, dtype for dtype."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    rows = dict(re.findall(r"^\| (float\d+|bfloat16) \| ([0-9.e-]+) \|$", text, flags=re.M))
    assert {getattr(torch, name): float(v) for name, v in rows.items()} == PARITY_RTOL


def test_builds_of_one_target_take_turns_on_its_build_folder(tmp_path):
    """Every build empties its target's build folder first and cannot move it (kernels record their
    path), so a second build must wait for the first, not delete its kernels: two CPU builds run
    side by side once wrote a bundle whose piece did not match its own hash."""
    import threading
    import time

    from hgc.build_command import build_lock

    work, events, said = tmp_path / "build" / "cpu-key", [], []
    first_holds, first_may_go = threading.Event(), threading.Event()

    def first():
        with build_lock(work):
            events.append("first in")
            first_holds.set()
            first_may_go.wait(10)
            events.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    assert first_holds.wait(10)
    threading.Timer(0.3, first_may_go.set).start()
    started = time.perf_counter()
    with build_lock(work, log=said.append):
        events.append("second in")
    thread.join(10)
    assert events == ["first in", "first out", "second in"]
    assert time.perf_counter() - started >= 0.25
    assert said == [f"waiting for another hgc build that uses {work}"]


def test_a_size_read_across_an_op_core_is_taken_from_a_tensor_input_and_compiles(tmp_path_factory, tmp_path,
                                                                                 one_thread):
    """Ling's MLA layers view the attention's output with the token count the first glue segment
    took from input_ids (`sym_size.int`). Inductor's C++ wrapper takes tensors only (it passes None
    for a SymInt input), so such a segment takes the count from a tensor it reads itself; its
    piece compiles and, at a token count other than the traced one, gives the traced glue's values."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env
    from compiler.splitops.glue import glue_segments, segment_module
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs

    gm = load_programs(read_artifact(shared_artifact(tmp_path_factory, "bailing_linear")[1]))["main"].graph_module
    by_name = {n.name: n for n in gm.graph.nodes}

    def reads_a_size(segment) -> bool:
        return any(isinstance(a.meta["val"], torch.SymInt) and a.name not in segment.nodes
                   for n in segment.nodes for a in by_name[n].all_input_nodes)

    segment = next((s for s in glue_segments(gm) if s.outputs and reads_a_size(s)), None)
    assert segment is not None, "some bailing_linear glue segment reads a token count taken before an op core"
    assert all(isinstance(by_name[n].meta["val"], torch.Tensor) for n in segment.inputs), segment.inputs
    module = segment_module(gm, segment)
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, torch.device("cpu"))

    rows = 3  # not the traced token count: a count fixed at compile time would fail here
    assert rows not in {optimization_hint(d) for n in segment.inputs for d in by_name[n].meta["val"].shape
                        if not isinstance(d, int)}

    def concrete(dim) -> int:  # every symbolic size at `rows`
        if isinstance(dim, int):
            return dim
        return int(dim.node.expr.xreplace(dict.fromkeys(dim.node.expr.free_symbols, rows)))

    torch.manual_seed(0)
    inputs = []
    for name in segment.inputs:
        val = by_name[name].meta["val"]
        t = torch.empty_strided([concrete(d) for d in val.shape], [concrete(d) for d in val.stride()], dtype=val.dtype)
        inputs.append(t.normal_() if t.is_floating_point() else t.random_(0, 3))
    expected, got = module(*inputs), piece(*inputs)
    assert len(got) == len(expected) == len(segment.outputs)
    allocations = (torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default)  # an op core's `out`
    for name, g, e in zip(segment.outputs, got, expected):
        assert g.shape == e.shape, name
        if by_name[name].target not in allocations:
            # float32 rounding, as the relative error of the norm (values reach 1e3 here, so an
            # elementwise tolerance fails on elements that cancel to near zero)
            err = float((g.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30))
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_export_dtype_asserts_are_dropped_from_a_piece_before_inductor():
    """The piece's graph loses export's dtype asserts (non-pointwise readers, which change what
    Inductor fuses around them) and keeps every other node, computing the same values."""
    from compiler.inductor_pieces import drop_metadata_asserts

    graph = torch.fx.Graph()
    x, w, residual = (graph.placeholder(n) for n in ("x", "w", "residual"))
    total = graph.call_function(torch.ops.aten.add.Tensor, (residual, graph.call_function(torch.ops.aten.mm.default, (x, w))))
    graph.call_function(torch.ops.aten._assert_tensor_metadata.default, (total,), {"dtype": torch.float32})
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (total, 2.0)))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    args = (torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5))
    expected = module(*args)
    assert drop_metadata_asserts(module.graph) == 1
    module.recompile()
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.mm.default, torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor]
    torch.testing.assert_close(module(*args), expected, rtol=0, atol=0)


@pytest.mark.parametrize("small_m", [False, True])
def test_compile_glue_records_the_projections_it_made_gemv_calls(tmp_path_factory, tmp_path, monkeypatch, small_m):
    """compile_glue(small_m=True) rewrites each segment before its key is taken and it compiles
    (Inductor stood in for: what is compiled is recorded), and each piece record says how many
    projections call the GEMV op; per forward, every segment counted with its piece's count, that
    is every projection of the traced glue (a qwen3_next program's are all plain). Without it, none."""
    import compiler.inductor_pieces as inductor_pieces
    from compiler.splitops.glue_ops import SMALL_M_LINEAR
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs

    docs = read_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])
    programs = {p: ep.graph_module for p, ep in load_programs(docs).items()}
    compiled = stand_in_inductor(monkeypatch, lambda module: sum(n.target is SMALL_M_LINEAR for n in module.graph.nodes))
    records, pieces = inductor_pieces.compile_glue(programs, docs.split_plans, "cpu", tmp_path, tmp_path / "cache",
                                                   small_m=small_m)
    assert sorted(p["small_m_linear"] for p in pieces.values()) == sorted(compiled)
    for program, gm in programs.items():
        linears = sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)
        made = sum(pieces[r["piece"]]["small_m_linear"] for r in records[program] if r["piece"])
        assert linears > 0 and made == (linears if small_m else 0), program
        assert not any(n.target is SMALL_M_LINEAR for n in gm.graph.nodes), "the program itself stays traced glue"


def test_inspect_counts_each_segment_with_its_pieces_gemv_projections():
    """`hgc inspect`'s "GEMV projections": per program, every glue segment counted with its piece's
    count (a structure shared by many layers counts once per layer); off, or unknown for a bundle
    built before bundle.json said."""
    from hgc.compile_commands import gemv_projections

    doc = {"small_m_linear": True,
           "pieces": {"pieces/a.bin": {"small_m_linear": 2}, "pieces/b.bin": {"small_m_linear": 1}},
           "programs": {"draft": [{"piece": "pieces/b.bin"}],
                        "main": [{"piece": "pieces/a.bin"}, {"piece": None}, {"piece": "pieces/a.bin"},
                                 {"piece": "pieces/b.bin"}]}}  # bundle.json's keys are sorted
    assert gemv_projections(doc) == "main 5, draft 1"
    assert gemv_projections({**doc, "small_m_linear": False}) == "off"
    assert gemv_projections({k: v for k, v in doc.items() if k != "small_m_linear"}) == "-"
