"""The artifact: what `hgc compile` writes, what `hgc run` / `hgc inspect` read, and bad input.

- compile writes every file with its hash in manifest.json; compiling twice is byte-identical;
- `hgc run` prints the same JSON as `hgc generate` and the same tokens; --link-weights too;
- a checkpoint that fails lints, an unwritable output folder, an existing artifact (without
  --force) and a compile that dies half-way each give a clear message and leave nothing behind;
- the loader refuses changed files, unlisted files, and .pt2 archives carrying a pickle payload,
  a code-reaching node target or an evaluating symbolic expression, without running the payload.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import onnx
import pytest

from hgc import main
from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.pipeline import LintFailure, compile_checkpoint
from compiler.splitops.artifact import FORMAT_VERSION, GRAPH, MANIFEST, SPLIT, dump_json, sha256_file
from testkit.helpers import rehash
from models.loader import init_checkpoint
from runtime.artifact.loader import LoadError, load_artifact, read_artifact

FAMILY = "qwen3_next"  # has a draft program: both .pt2 files are exercised
PROMPTS = "1,2,3,4,5,6,7,8;9,10,11"


pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces", "shared_loads")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_checkpoint(FAMILY, "tiny", seed=1, out_dir=tmp_path_factory.mktemp("ckpt") / "tiny",
                           log=open(os.devnull, "w"))


@pytest.fixture(scope="module")
def artifact(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    assert main(["compile", str(ckpt), "-o", str(out)]) == 0
    return out


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# -- what compile writes -----------------------------------------------------------------------------


def test_compile_writes_every_file_with_its_hash(artifact):
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["family"] == FAMILY
    assert set(manifest["versions"]) == {"hgc", "torch", "python"}
    for name in ("graph.pt2", "draft.pt2", "weights.safetensors", "weights.json", "routing.json", "split.json",
                 "lints.json", "dumps/00_export.onnx", "dumps/06_lint_capture.svg", "dumps/draft/05_split.txt"):
        assert manifest["files"][name] == sha256_file(artifact / name), name
    assert manifest["buckets"]["decode_batch_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert manifest["buckets"]["extend_token_counts"][-1] == 4096
    assert [p["name"] for p in manifest["passes"]] == ["annotate", "lint_registry", "fusion", "routing", "split",
                                                       "lint_capture"]
    assert manifest["registry"][-1]["draft"] is True and manifest["weights"]["mode"] == "copy"
    assert oct((artifact).stat().st_mode & 0o777) != oct(0o700)


def test_caches_take_the_compile_dtype_not_the_configs(ckpt, tmp_path):
    """tiny's config says float32; compiled in bfloat16 the model computes in bf16, so its KV and
    conv caches are bf16 (a float32 KV cache made FlashInfer plan for the wrong dtype pair on the
    GPU); the recurrent state stays float32, as the family declares it."""
    out = tmp_path / "bf16"
    assert main(["compile", str(ckpt), "-o", str(out), "--dtype", "bfloat16", "--no-dumps"]) == 0
    dtypes = {name: spec.dtype for layer in load_artifact(out, "cpu").registry.layers
              for name, spec in {**layer.kv, **layer.state}.items()}
    assert dtypes == {"k": "bfloat16", "v": "bfloat16", "conv": "bfloat16", "recurrent": "float32"}


def test_compile_twice_is_byte_identical(ckpt, artifact, tmp_path):
    again = tmp_path / "again"
    assert main(["compile", str(ckpt), "-o", str(again), "--no-dumps"]) == 0
    for name in ("graph.pt2", "draft.pt2", "routing.json", "split.json", "weights.safetensors", "weights.json"):
        assert (again / name).read_bytes() == (artifact / name).read_bytes(), name


def test_the_programs_are_torchs_own_save_of_them_byte_for_byte(ckpt, artifact, tmp_path):
    """The writer saves the programs without the canonical-form test torch's serializer runs and
    discards (compiler/artifact_writer.py): the same bytes as torch.export.save with it."""
    import torch

    from compiler.pipeline import plan
    from compiler.splitops.artifact import PROGRAM_FILES

    for program, ep in plan(ckpt, CompileConfig(), toolchain()).traced.programs.items():
        torch.export.save(ep, tmp_path / PROGRAM_FILES[program])
        assert (tmp_path / PROGRAM_FILES[program]).read_bytes() == (artifact / PROGRAM_FILES[program]).read_bytes()


def test_graph_pt2_holds_no_source_paths(artifact):
    """Stack traces are not recorded: graph.pt2 does not depend on where the code is checked out."""
    archive = zipfile.ZipFile(artifact / GRAPH)
    model_json = archive.read(next(n for n in archive.namelist() if n.endswith("models/model.json")))
    assert str(Path(__file__).resolve().parents[2]).encode() not in model_json


def test_tokenizer_files_are_copied_and_listed(ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    (copy / "tokenizer.json").write_text('{"version": "1.0"}')
    (copy / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    out = tmp_path / "art"
    compile_checkpoint(copy, out, CompileConfig(), toolchain(), dumps=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tokenizer"] == ["tokenizer.json", "tokenizer_config.json"]
    assert manifest["files"]["tokenizer.json"] == sha256_file(out / "tokenizer.json")
    read_artifact(out)  # listed, so accepted


def test_every_dump_passes_the_onnx_checker(artifact):
    paths = list((artifact / "dumps").rglob("*.onnx"))
    assert len(paths) == 14  # 00..06 for main and draft
    for path in paths:
        onnx.checker.check_model(onnx.load(str(path)))


# -- run and inspect ------------------------------------------------------------------------------------


def test_run_prints_the_same_json_as_generate(ckpt, artifact, capsys):
    assert main(["generate", str(ckpt), "--prompt-ids", PROMPTS, "--max-new-tokens", "5", "--json"]) == 0
    eager = _json_out(capsys)
    assert main(["run", str(artifact), "--prompt-ids", PROMPTS, "--max-new-tokens", "5", "--json"]) == 0
    ran = _json_out(capsys)
    assert ran["outputs"] == eager["outputs"]
    # run adds the engine's per-phase timing, each prompt's prefix-cache hit and what each layer's op
    # calls ran on, nothing else
    assert set(ran) == {"outputs", "timing", "cached_tokens", "executed_backends"}
    assert ran["executed_backends"] == {str(i): ["cpu_reference"] for i in range(4)}  # main layers; no draft runs


def test_link_weights_records_files_and_binds_the_same_weights(ckpt, artifact, tmp_path):
    linked = tmp_path / "linked"
    assert main(["compile", str(ckpt), "-o", str(linked), "--link-weights", "--no-dumps"]) == 0
    manifest = json.loads((linked / MANIFEST).read_text())
    assert not (linked / "weights.safetensors").exists() and manifest["weights"]["mode"] == "link"
    entry = manifest["weights"]["files"][0]
    assert entry["size"] == (ckpt / "model.safetensors").stat().st_size and len(entry["header_sha256"]) == 64
    assert Path(entry["absolute_path"]) == (ckpt / "model.safetensors").resolve()
    from_link, copied = load_artifact(linked).weights, load_artifact(artifact).weights
    assert from_link.keys() == copied.keys() and all(from_link[k].equal(copied[k]) for k in copied)


def test_link_weights_refuses_a_changed_checkpoint(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    linked = tmp_path / "linked"
    compile_checkpoint(copy, linked, CompileConfig(), toolchain(), link_weights=True, dumps=False)
    tensors = load_file(copy / "model.safetensors")
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt", "edited": "yes"})
    with pytest.raises(LoadError, match="checkpoint changed after compile"):
        load_artifact(linked)


def test_inspect_prints_routing_split_and_lints(artifact, capsys):
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert "cpu_reference" in out and "gdn_fused=gdn" in out and "extend" in out and "no findings" in out
    assert main(["inspect", str(artifact), "--json"]) == 0
    doc = _json_out(capsys)
    layers = [(r["program"], r["layer"], r["kind"]) for r in doc["layers"]]
    assert layers == [("main", 0, "gdn"), ("main", 1, "gdn"), ("main", 2, "gdn"), ("main", 3, "full_gqa"),
                      ("draft", 4, "full_gqa")]
    assert {r["mode"] for r in doc["split"]} == {"decode", "extend", "mixed", "target_verify"}


def test_plan_only_works_on_a_folder_with_only_config(ckpt, tmp_path, capsys):
    only = tmp_path / "only_config"
    only.mkdir()
    shutil.copy(ckpt / "config.json", only / "config.json")
    assert main(["compile", str(only), "--plan-only", "--json"]) == 0
    doc = _json_out(capsys)
    assert doc["family"] == FAMILY and doc["counts"]["error"] == 0 and len(doc["layers"]) == 5
    assert sorted(p.name for p in only.iterdir()) == ["config.json"]


# -- bad input --------------------------------------------------------------------------------------------


def test_compiling_a_folder_without_weights_says_so(ckpt, tmp_path, capsys):
    only = tmp_path / "only_config"
    only.mkdir()
    shutil.copy(ckpt / "config.json", only / "config.json")
    assert main(["compile", str(only), "-o", str(tmp_path / "art")]) == 2
    assert "no *.safetensors files" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["only_config"]


def test_existing_output_is_refused_unless_force(ckpt, artifact, tmp_path, capsys):
    out = tmp_path / "art"
    out.mkdir()
    assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps", "--force"]) == 0  # an empty folder
    assert (out / GRAPH).is_file() and not _leftovers(tmp_path, "art")
    (out / GRAPH).write_bytes(b"stale")
    assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps", "--force"]) == 0  # an artifact
    assert (out / GRAPH).read_bytes() != b"stale" and not _leftovers(tmp_path, "art")


def test_force_onto_a_folder_that_is_not_an_artifact_leaves_it_untouched(ckpt, tmp_path, capsys):
    notes = tmp_path / "notes"
    (notes / "2026").mkdir(parents=True)
    (notes / "todo.txt").write_text("mine")
    (notes / "2026" / "plan.md").write_text("also mine")
    (notes / "manifest.json").write_text('{"format": "something else"}')
    before = {p: p.read_bytes() for p in notes.rglob("*") if p.is_file()}
    assert main(["compile", str(ckpt), "-o", str(notes), "--no-dumps", "--force"]) == 2
    err = capsys.readouterr().err
    assert "refusing to replace it with --force: it is not an hgc artifact" in err and "todo.txt" in err
    assert {p: p.read_bytes() for p in notes.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no staging folder left either


HOLD_STAGING = ("import sys, time, compiler.artifact_writer as w\n"
                "with w.staging_folder(sys.argv[1]) as tmp:\n"
                "    (tmp / 'graph.pt2').write_bytes(b'half')\n"
                "    print(tmp, flush=True)\n"
                "    time.sleep(600)\n")


def _holding(out: Path):
    """A process that has claimed `out`'s staging folder and sleeps with it (it prints the folder)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", HOLD_STAGING, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env)


def test_a_killed_compiles_staging_folder_is_gone_after_the_next_compile(ckpt, tmp_path):
    """A compile killed with SIGKILL (no cleanup runs) leaves .NAME.partial-claim; it holds no lock,
    so the next compile into the same place removes it and claims the output itself."""
    import signal

    out = tmp_path / "art"
    killed = _holding(out)
    try:
        stale = Path(killed.stdout.readline().strip())
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert stale.is_dir() and stale.name == ".art.partial-claim"
        assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps"]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    finally:
        killed.kill()


def test_the_second_of_two_compiles_into_one_place_exits_2_naming_the_first(ckpt, tmp_path, capsys):
    out = tmp_path / "art"
    live = _holding(out)
    try:
        held = Path(live.stdout.readline().strip())
        assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps", "-q"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hgc compile: {out}: another hgc compile (pid {live.pid}) is writing it now"), err
        # the first's folder and the note of its pid untouched
        assert sorted(p.name for p in tmp_path.iterdir()) == [held.name, f"{held.name}.pid"]
        assert (held / "graph.pt2").read_bytes() == b"half"
    finally:
        live.kill()
        live.wait(30)


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_made_at_the_output_during_the_compile_is_never_replaced(ckpt, tmp_path, capsys, monkeypatch,
                                                                          force):
    """The output was free when the compile began; a user makes a folder there meanwhile. The final
    move refuses it (with --force too: it is not an artifact), and the user's file is kept."""
    import compiler.artifact_writer as writer

    out = tmp_path / "art"
    real = writer.write_artifact

    def user_meanwhile(*args, **kwargs):
        manifest = real(*args, **kwargs)
        out.mkdir()
        (out / "mine.txt").write_text("mine")
        return manifest

    monkeypatch.setattr(writer, "write_artifact", user_meanwhile)
    assert main(["compile", str(ckpt), "-o", str(out), "--no-dumps", "-q", *(["--force"] if force else [])]) == 2
    err = capsys.readouterr().err
    pattern = r"refusing to replace it with --force: it is not an hgc artifact" if force else \
        r"appeared while this compile ran; nothing was replaced"
    assert re.search(rf"^hgc compile: {re.escape(str(out))}: {pattern}", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"] and (out / "mine.txt").read_text() == "mine"
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_a_staging_folder_swept_by_another_compile_before_it_is_locked_is_no_error(tmp_path, monkeypatch):
    """Two compiles into one place start together: each sweep may remove the other's new folder
    between finding (or making) it and opening it for the lock. The sweep skips it; the maker makes
    another. (Both once turned into "cannot write into ... (No such file or directory)".)"""
    import compiler.artifact_writer as writer

    real_lock, swept = writer._lock, []

    def taken_first(folder):  # another compile's sweep removes the folder just before this one opens it
        if not swept:
            swept.append(folder)
            shutil.rmtree(folder)
        return real_lock(folder)

    (tmp_path / ".art.partial-other").mkdir()
    monkeypatch.setattr(writer, "_lock", taken_first)
    assert writer.sweep_stale_staging(tmp_path, "art") == [] and swept == [tmp_path / ".art.partial-other"]
    swept.clear()
    with writer.staging_folder(tmp_path / "art") as tmp:
        # the claim was swept between its mkdir and its lock: made again under the one claim name
        assert tmp.is_dir() and swept == [tmp] and tmp.name == ".art.partial-claim"
        (tmp / "x").write_text("y")
    assert (tmp_path / "art" / "x").read_text() == "y"


def test_unwritable_output_folder_is_a_clear_message(ckpt, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert main(["compile", str(ckpt), "-o", str(blocker / "art")]) == 2
    err = capsys.readouterr().err
    assert "cannot write into" in err and "choose a writable output folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_output_over_the_checkpoint_is_refused(ckpt, capsys):
    assert main(["compile", str(ckpt), "-o", str(ckpt), "--force"]) == 2
    assert "holds the checkpoint" in capsys.readouterr().err
    assert (ckpt / "model.safetensors").is_file()


def test_checkpoint_failing_lints_writes_nothing(ckpt, tmp_path, monkeypatch, capsys):
    import models.qwen3_next as family_module
    from compiler.splitops import LayerRegistry

    def broken_build(cfg):  # the registry claims an extra layer no module runs
        model = family_module.Qwen3NextForCausalLM(cfg)
        extra = dataclasses.replace(model.layer_registry.main_layers()[0], layer_id=99)
        model.layer_registry = LayerRegistry(list(model.layer_registry) + [extra])
        return model

    monkeypatch.setattr(family_module, "FAMILY", dataclasses.replace(family_module.FAMILY, build=broken_build))
    out = tmp_path / "art"
    assert main(["compile", str(ckpt), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lint error(s); nothing was written" in err and "layer-without-op" in err and "layer 99" in err
    assert not out.exists() and not _leftovers(tmp_path, "art")
    assert main(["lint", str(ckpt)]) == 2
    assert "layer-without-op" in capsys.readouterr().out


def test_a_compile_that_dies_half_way_leaves_nothing(ckpt, tmp_path, monkeypatch):
    import compiler.artifact_writer as writer

    def dies(tmp, *args, **kwargs):
        (tmp / "graph.pt2").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_artifact", dies)
    with pytest.raises(KeyboardInterrupt):
        compile_checkpoint(ckpt, tmp_path / "art", CompileConfig(), toolchain(), dumps=False)
    assert list(tmp_path.iterdir()) == []


def test_lint_failure_lists_each_error():
    from compiler.lints import Finding
    err = LintFailure([Finding("layer-without-op", "error", "registry layer 9 unused", "drop it", "main", layer_id=9)])
    assert "1 lint error(s)" in str(err) and "layer-without-op: registry layer 9 unused (fix: drop it)" in str(err)


# -- loader refusals ----------------------------------------------------------------------------------------


def _clone(artifact: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "clone"
    shutil.copytree(artifact, dest)
    return dest


def _rewrite_pt2(path: Path, edit) -> None:
    """Rebuild a .pt2 zip with `edit(name, bytes) -> bytes | None` (None drops the entry) and extra entries."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = edit(info.filename, src.read(info.filename))
            if data is not None:
                dst.writestr(info.filename, data)
        for name, data in getattr(edit, "extra", {}).items():
            dst.writestr(name, data)
    path.write_bytes(out.getvalue())


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loader_refuses_a_modified_file(artifact, tmp_path):
    art = _clone(artifact, tmp_path)
    (art / SPLIT).write_text((art / SPLIT).read_text().replace('"captured"', '"eager"', 1))
    with pytest.raises(LoadError, match="split.json was modified"):
        read_artifact(art)


def test_loader_refuses_unlisted_files(artifact, tmp_path):
    art = _clone(artifact, tmp_path)
    (art / "extra.py").write_text("print('hi')")
    with pytest.raises(LoadError, match="not listed in manifest.json"):
        read_artifact(art)


def test_loader_refuses_another_format_version(artifact, tmp_path):
    art = _clone(artifact, tmp_path)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["format_version"] = 99
    (art / MANIFEST).write_bytes(dump_json(manifest))
    with pytest.raises(LoadError, match="format_version 99"):
        read_artifact(art)


@pytest.mark.parametrize("where", ["sample_inputs", "weights"])
def test_loader_never_unpickles_a_planted_payload(artifact, tmp_path, where):
    art = _clone(artifact, tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))

    def edit(name, data):
        if where == "sample_inputs" and name.endswith("data/sample_inputs/model.pt"):
            return payload
        if where == "weights" and name.endswith("model_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"]))
            config["config"][first]["use_pickle"] = True
            return json.dumps(config).encode()
        if where == "weights" and name.endswith("data/weights/weight_0"):
            return payload
        return data

    _rewrite_pt2(art / GRAPH, edit)
    rehash(art)
    with pytest.raises(LoadError, match="pickle|weightless"):
        load_artifact(art)
    assert not marker.exists()


def test_loader_refuses_a_node_target_that_reaches_python(artifact, tmp_path):
    art = _clone(artifact, tmp_path)

    def edit(name, data):
        if name.endswith("models/model.json"):
            return data.replace(b'"torch.ops.aten.embedding.default"', b'"torch.os.system"', 1)
        return data

    _rewrite_pt2(art / GRAPH, edit)
    rehash(art)
    with pytest.raises(LoadError, match="node target 'torch.os.system'"):
        load_artifact(art)


def test_loader_refuses_an_evaluating_symbolic_expression(artifact, tmp_path):
    art = _clone(artifact, tmp_path)
    marker = tmp_path / "pwned"

    def edit(name, data):
        if name.endswith("models/model.json"):
            doc = json.loads(data)
            evil = f"__import__('os').system('touch {marker}')"
            text = json.dumps(doc)
            first = text.index('"expr_str": "') + len('"expr_str": "')
            end = text.index('"', first)
            return (text[:first] + evil.replace('"', '\\"') + text[end:]).encode()
        return data

    _rewrite_pt2(art / GRAPH, edit)
    rehash(art)
    with pytest.raises(LoadError, match="symbolic expression"):
        load_artifact(art)
    assert not marker.exists()


def test_loader_refuses_aoti_code_in_the_archive(artifact, tmp_path):
    art = _clone(artifact, tmp_path)
    root = zipfile.ZipFile(art / GRAPH).namelist()[0].split("/")[0]
    edit = lambda name, data: data  # noqa: E731
    edit.extra = {f"{root}/data/aotinductor/model/model.so": b"\x7fELF"}
    _rewrite_pt2(art / GRAPH, edit)
    rehash(art)
    with pytest.raises(LoadError, match="unexpected archive entry"):
        load_artifact(art)


def test_loader_refuses_a_backend_the_artifact_does_not_route_to(artifact):
    from runtime.step.bound_ops import BoundOps

    class OtherBackend:
        name = "other"

        def __getattr__(self, op):
            return lambda *a: None

    art = load_artifact(artifact)
    with pytest.raises(LoadError, match=r"binds layer \d+ \(main program, node \w+, hgc.\w+\) to cpu_reference, "
                                        r"and the op table offers \['other'\]"):
        art.bind(BoundOps(OtherBackend()))
