"""Compiled pieces on tensor-parallel ranks, on the CPU (gloo), in real rank processes.

`hgc compile --tp 2 --target cpu --inductor` launches two ranks that each compile the glue for their
own device and start up together (collectives between the pieces); the bundle holds both ranks'
pieces and kernels under one signed bundle.json. Then:

- `hgc run --tp 2` gives the float32 tokens of `hgc generate`, each rank loading its own pieces and
  building nothing (rank 0's report; another rank that built something would fail its start-up);
- a flipped byte in rank 1's piece is refused before any rank is launched, naming the file;
- a bundle whose rank count is not the artifact's is refused, naming both and the command that
  rebuilds.

Kimi-Linear: KDA and MLA layers, an all-reduce after each MoE and row-parallel projection, and an MLA
glue segment that reads a size across an op core (compiler/splitops/glue.py). One build for the module,
of a 2-layer checkpoint (a KDA layer with the dense MLP, an MLA layer with the MoE): every kind of
layer and collective of the 4-layer tiny model, with fewer distinct pieces for each rank's Inductor
build, which is most of the module's time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hgc import main
from compiler.splitops.bundle import BUNDLE, TARGETS, target_facts, target_key
from testkit.helpers import ROOT, tiny_checkpoint
from tests.compiler.test_inductor_pieces import rewrite_bundle

pytestmark = pytest.mark.slow  # one compile and build on two ranks (about a minute), two launches

PROMPTS = "1,2,3,4,5,6,7,8;9,10,11"
NEW_TOKENS = 5


def two_layers() -> dict:
    """Tiny's config overrides for layer 0 KDA (the dense MLP: first_k_dense_replace 1) and layer 1
    MLA (the MoE); Kimi's config numbers layers from 1."""
    from models.families import get_family

    linear = get_family("kimi_linear").make_config("tiny")["linear_attn_config"]
    return {"num_hidden_layers": 2, "linear_attn_config": {**linear, "kda_layers": [1], "full_attn_layers": [2]}}


def hgc(*argv: str, home) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HGC_HOME=str(home), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hgc", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def run_tp2(art, home) -> subprocess.CompletedProcess:
    return hgc("run", str(art), "--tp", "2", "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json",
               home=home)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_compiled")
    ckpt = tiny_checkpoint("kimi_linear", root / "ckpt", seed=3, **two_layers())
    proc = hgc("compile", str(ckpt), "-o", str(root / "art"), "--tp", "2", "--target", "cpu", "--inductor",
               "--no-dumps", home=root / "home")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "ckpt": ckpt, "art": root / "art", "home": root / "home", "log": proc.stderr,
            "key": target_key(target_facts("cpu"))}


def _copy(built, name: str):
    dest = built["root"] / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(built["art"], dest)
    return dest


def test_the_ranks_build_one_bundle_with_each_ranks_pieces(built, monkeypatch, capsys):
    folder = built["art"] / TARGETS / built["key"]
    doc = json.loads((folder / BUNDLE).read_text())
    assert doc["ranks"] == 2 and doc["pieces"] and doc["signature"]
    for rank in (0, 1):
        for piece in doc["pieces"]:
            assert (folder / f"rank{rank}" / piece).is_file()
        assert any(f.startswith(f"rank{rank}/kernels/inductor/") for f in doc["files"])
    assert len(doc["parity_per_rank"]) == 2 and all(doc["parity_per_rank"])
    assert "match the traced glue" in built["log"]
    monkeypatch.setenv("HGC_HOME", str(built["home"]))
    capsys.readouterr()
    assert main(["inspect", str(built["art"]), "--json"]) == 0  # in this process: inspect starts no rank
    [row] = json.loads(capsys.readouterr().out)["bundles"]
    assert row["ranks"] == 2 and row["pieces"] == 2 * len(doc["pieces"]), row


def test_tp2_runs_its_compiled_pieces_with_the_tokens_of_generate(built, capsys):
    assert main(["generate", str(built["ckpt"]), "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS),
                 "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    proc = run_tp2(built["art"], built["home"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two["outputs"] == one["outputs"]
    report = two["compiled"]
    assert report["target"] == built["key"] and report["pieces"] >= 1
    assert report["kernel_builds"] == 0 and report["inductor_compiles"] == 0
    assert report["parity"] and report["worst_op_rel_err"] < 1e-4
    assert all(set(b) == {"cpu_reference", "gloo"} for b in two["executed_backends"].values()), two


def test_a_flipped_byte_in_rank_1s_piece_is_refused(built, monkeypatch, capfd):
    art = _copy(built, "flipped")
    victim = next((art / TARGETS / built["key"] / "rank1" / "pieces").glob("*.bin"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    # `hgc run --tp 2` in this process, the one that would launch the ranks (capfd: a rank's stderr too)
    monkeypatch.setenv("HGC_HOME", str(built["home"]))
    capfd.readouterr()
    code = main(["run", str(art), "--tp", "2", "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json"])
    err = capfd.readouterr().err
    assert code == 2  # refused before any rank is launched: the hashes are read first
    assert "launched" not in err
    assert f"rank1/pieces/{victim.name}" in err and "does not match manifest.json" in err


def test_a_bundle_for_another_rank_count_is_refused(built, monkeypatch):
    art = _copy(built, "one_rank")

    def drop_rank_1(doc, folder):  # as a build of the same program on one process would list it
        doc["ranks"] = 1
        shutil.rmtree(folder / "rank1")
        for item in (folder / "rank0").iterdir():
            item.rename(folder / item.name)
        (folder / "rank0").rmdir()

    monkeypatch.setenv("HGC_HOME", str(built["home"]))  # re-signed with the building installation's key
    rewrite_bundle(art, built["key"], drop_rank_1)
    proc = run_tp2(art, built["home"])
    assert proc.returncode == 1, proc.stderr[-2000:]  # the launcher's status when a rank failed (each said 2)
    assert "holds pieces for 1 rank(s), the artifact runs on 2" in proc.stderr and "hgc build" in proc.stderr
