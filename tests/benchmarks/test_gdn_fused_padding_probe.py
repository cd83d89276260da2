"""benchmarks/probes/gdn_fused_padding_probe.py: the stage it names, and its refusal of an unknown
variant (its runs themselves need the GPU's kernels or, on the CPU, minutes of the interpreter)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "gdn_fused_padding_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("gdn_fused_padding_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage(rel_err, nan_padded=0, nan_plain=0):
    return {"rel_err": rel_err, "nan_padded": nan_padded, "nan_plain": nan_plain}


def test_first_fault_is_the_first_stage_beyond_tolerance_or_with_nan(probe):
    agree = {"layer": 0, "conv": _stage(0.0), "q": _stage(1e-3), "core": _stage(5e-3)}
    core = {"layer": 1, "conv": _stage(0.0), "q": _stage(0.0), "core": _stage(float("inf")), "norm": _stage(0.4)}
    assert probe.first_fault({"stages": [agree, core]}) == "layer 1 core: rel err inf, nan 0/0"
    nan = {"layer": 2, "conv": _stage(0.0, nan_padded=3), "core": _stage(0.5)}
    assert probe.first_fault({"stages": [agree, nan, core]}) == "layer 2 conv: rel err 0, nan 3/0"
    assert probe.first_fault({"stages": [{"layer": 0, "core": _stage(float("nan"))}]}).startswith("layer 0 core")
    assert probe.first_fault({"stages": [agree]}) == "none"


def test_an_unknown_variant_is_refused_in_one_line(probe, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--out", str(tmp_path / "out"), "--variants", "default,bogus"])
    assert exit_.value.code == 2
    assert "--variants: unknown bogus" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
