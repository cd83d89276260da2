"""The bundle choices of `hgc build` and `hgc compile` (hgc/build_command.py `BundleChoices`): --pdl,
--norm-linear, --norm-rope, --sigmoid-gate.

Each is a decision of a cuda target bundle: asked of a cpu bundle (by `hgc build`, or by `hgc
compile` with or without --inductor) it is one line naming the flag and why, the documented exit
code, and nothing written; asked of a cuda compile that builds no bundle, it says so. The record
itself: read from the flags, written back as the flags (a tensor-parallel build's ranks and the
rebuild hint take them so), the first refusal in the flags' order, --norm-rope's default by device.
bundle.json records the rewrites and `hgc inspect` counts their calls per forward.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from compiler.splitops.artifact import ArtifactFormatError
from compiler.splitops.bundle import (bundle_doc, bundle_norm_linear, bundle_norm_rope, bundle_sigmoid_gate,
                                     parse_bundle_doc)
from hgc import main
from hgc.build_command import BundleChoices
from hgc.compile_commands import folded_norms, norm_rope_calls, sigmoid_gate_calls
from hgc.errors import EXIT_BAD_INPUT

# flag -> how its refusal of a cpu bundle begins
CPU_REFUSALS = {"--pdl": "programmatic dependent launch is a CUDA launch attribute",
                "--norm-linear": "the norms fold into the projections' GEMV",
                "--norm-rope": "the q / k norms and rotary run as one CUDA kernel",
                "--sigmoid-gate": "the attention output's gate runs as one CUDA kernel"}
FORMS = {"build": ["build", "{w}/art", "--device", "cpu"],
         "compile": ["compile", "{w}/ckpt", "-o", "{w}/new", "--target", "cpu"],
         "compile --inductor": ["compile", "{w}/ckpt", "-o", "{w}/new", "--target", "cpu", "--inductor"]}


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("flag", sorted(CPU_REFUSALS))
def test_a_choice_for_a_cpu_bundle_is_one_line_and_writes_nothing(tmp_path, capsys, flag, form):
    (tmp_path / "ckpt").mkdir()
    before = tree(tmp_path)
    argv = [a.replace("{w}", str(tmp_path)) for a in FORMS[form]] + [flag]
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"hgc {argv[0]}: {flag}: {CPU_REFUSALS[flag]}"), err
    assert "cpu bundle" in err[0] and len(err) <= 3 and "Traceback" not in "\n".join(err)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("flag", sorted(CPU_REFUSALS))
def test_a_cuda_compile_that_builds_no_bundle_refuses_a_choice(tmp_path, capsys, flag):
    (tmp_path / "ckpt").mkdir()
    argv = ["compile", str(tmp_path / "ckpt"), "-o", str(tmp_path / "new"), "--target", "cuda", "--no-inductor",
            flag]
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"hgc compile: {flag}: it is a choice of the target bundle, and this compile builds none")
    assert not (tmp_path / "new").exists()


def test_the_record_reads_and_writes_its_flags():
    args = argparse.Namespace(pdl=False, norm_linear=True, norm_rope=True, sigmoid_gate=None, device="cuda")
    choices = BundleChoices.of(args)
    assert choices == BundleChoices(norm_linear=True, norm_rope=True)
    assert choices.argv() == ["--norm-linear", "--norm-rope"] and BundleChoices().argv() == []
    assert choices.refusal("cuda") is None
    assert choices.refusal("cuda", batch_invariant=True).startswith("--norm-linear: the artifact is batch-invariant")
    assert BundleChoices(pdl=True, norm_rope=True).refusal("cpu").startswith("--pdl: "), "the flags' order"


@pytest.mark.parametrize("field", ["norm_linear", "norm_rope", "sigmoid_gate"])
def test_a_cuda_default_takes_the_device_and_a_flag_turns_it_off(field):
    """--norm-linear, --norm-rope and --sigmoid-gate take the device's default where no flag names
    them (on for cuda, off for cpu), --no-FLAG keeps Inductor's code; a rank's command line names
    only what a flag said. A build whose projections are not the GEMV op's calls (a batch-invariant
    artifact's) folds no norm by default, and keeps the two glue kernels."""
    from hgc.build_command import add_bundle_choices

    flag = "--" + field.replace("_", "-")
    parser = argparse.ArgumentParser()
    add_bundle_choices(parser)
    unnamed, off, on = (BundleChoices.of(parser.parse_args(a)) for a in ([], ["--no-" + flag[2:]], [flag]))
    assert getattr(unnamed, field) is None and unnamed.argv() == []
    assert getattr(unnamed.resolved("cuda", True), field) is True
    assert getattr(unnamed.resolved("cpu", False), field) is False
    assert getattr(off.resolved("cuda", True), field) is False and off.argv() == ["--no-" + flag[2:]]
    assert getattr(on.resolved("cuda", True), field) is True and on.argv() == [flag]
    assert unnamed.refusal("cpu") is None and off.refusal("cpu") is None, "only an asked choice is refused"
    assert getattr(unnamed.resolved("cuda", gemv_projections=False), field) is (field != "norm_linear")
    assert unnamed.refusal("cuda", batch_invariant=True) is None


@pytest.mark.parametrize("field,recorded,column", [("norm_linear", bundle_norm_linear, folded_norms),
                                                   ("norm_rope", bundle_norm_rope, norm_rope_calls),
                                                   ("sigmoid_gate", bundle_sigmoid_gate, sigmoid_gate_calls)])
def test_bundle_json_records_a_rewrite_and_inspect_counts_its_calls(field, recorded, column):
    facts = {"device": "cuda", "torch": torch.__version__}
    a, b = {"piece": "pieces/a.bin"}, {"piece": "pieces/b.bin"}
    programs = {"draft": [b], "main": [a, {"piece": None}, a, b]}  # a segment left traced names no piece
    pieces = {"pieces/a.bin": {"small_m_linear": 3, field: 2}, "pieces/b.bin": {"small_m_linear": 1, field: 1}}
    files = {name: "0" for name in pieces}
    for on in (False, True):
        doc = bundle_doc("sm90-x", facts, programs, {}, pieces, files, 1.0, "0", small_m=True, **{field: on})
        assert doc[field] is on and recorded(doc) is on
        assert column(doc) == ("main 5, draft 1" if on else "off")
        parse_bundle_doc(doc, "bundle.json")
    older = {k: v for k, v in doc.items() if k != field}
    assert recorded(older) is False and column(older) == "off", "a bundle from before the field"
    with pytest.raises(ArtifactFormatError, match=f"field '{field}' must be true or false"):
        parse_bundle_doc({**doc, field: 1}, "bundle.json")
