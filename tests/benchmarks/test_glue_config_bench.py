"""benchmarks/kernels/glue_config_bench.py --dry-run on the CPU (tiny qwen3_next, C++ glue): every distinct
glue piece compiled under two setting variants, each checked against the traced segment run eagerly
before it is timed, at two token counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "glue_config_bench.py"


def test_dry_run_checks_each_variant_then_times_it(tmp_path, tmp_path_factory):
    from testkit.helpers import shared_artifact

    # the artifact stage finds the test run's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out"),
                           "--work", str(work), "--tokens", "1,5",
                           "--variants", "bundle,no_combo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "out" / "glue_config_bench.json").read_text())
    assert set(doc["variants"]) == {"bundle", "no_combo"} and doc["variants"]["no_combo"]["patch"] == {
        "combo_kernels": False}
    # every distinct piece: some take a slice of a wider tensor (q out of the projection's output),
    # whose strides the compiled piece checks
    assert len(doc["pieces"]) >= 5
    for piece in doc["pieces"]:
        assert piece["segments"] >= 1 and set(piece["tokens"]) == {"1", "5"}
        for cell in piece["tokens"].values():
            for name in ("bundle", "no_combo"):
                assert cell[name]["ok"] and cell[name]["rel_err"] < 1e-4 and cell[name]["us"] > 0, cell
    assert set(doc["step_us"]) == {"1", "5"} and all(v > 0 for row in doc["step_us"].values() for v in row.values())
    assert "| tokens | bundle | no_combo |" in proc.stdout
    assert doc["rewrites"] == {"norm_linear": False, "norm_rope": False, "sigmoid_gate": False}, "a cpu bundle's rewrites"


def test_the_pieces_take_the_builds_rewrites(tmp_path_factory):
    """pieces() rewrites as compile_glue does: with sigmoid_gate, the GQA layer's piece calls the op."""
    sys.path.insert(0, str(SCRIPT.parent))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from glue_config_bench import pieces
    from compiler.splitops.glue_ops import SIGMOID_GATE
    from runtime.artifact.loader import load_artifact
    from testkit.helpers import shared_artifact

    gm = load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1]).programs["main"].graph_module
    calls = [sum(n.target is SIGMOID_GATE for n in e["module"].graph.nodes)
             for e in pieces(gm, small_m=False, limit=64, sigmoid_gate=True)]
    plain = [sum(n.target is SIGMOID_GATE for n in e["module"].graph.nodes)
             for e in pieces(gm, small_m=False, limit=64)]
    assert sum(calls) == 1 and sum(plain) == 0, (calls, plain)


def test_an_unknown_variant_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    # refused before any build: the script's main in this process
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from glue_config_bench import main

    with pytest.raises(SystemExit) as exit_:
        main(["--dry-run", "--out", str(tmp_path), "--variants", "bundle,fast"])
    assert exit_.value.code == 2 and "--variants: unknown ['fast']" in capsys.readouterr().err
