"""`hgc compile --target cuda` on this CPU machine: routing binds every op to a CUDA backend.

Nothing runs on a GPU here: the compiler imports each backend module only to read its `capability`
declaration (runtime/backends/__init__.py), so a CPU machine can compile for "cuda". For the tiny
checkpoint of every family the routing table must send full-attention ops to FlashInfer, the
linear-attention ops (and the short conv) to the Triton linear backend, and the MoE op to the
Triton MoE backend. The expected names are read from those classes' declarations, not spelled
twice. This fails as soon as any of them stops declaring every mode (routing needs one backend
per op node that supports all of them).
"""

from __future__ import annotations

import json
import os

import pytest

from compiler.cli import main as hgc
from compiler.splitops import FULL_KINDS, LINEAR_KINDS, MODES, LayerKind, Mode
from models.families import FAMILY_IDS
from models.loader import init_checkpoint
from runtime.backends.flashinfer_attention import FlashInferAttentionBackend
from runtime.backends.triton_linear_backend import TritonLinearBackend
from runtime.backends.triton_moe import TritonMoEBackend

FULL, LINEAR, MOE = (FlashInferAttentionBackend.capability, TritonLinearBackend.capability,
                     TritonMoEBackend.capability)


def expected_backend(op: str, kind: str | None) -> str:
    if op == "moe":
        return MOE.name
    return FULL.name if LayerKind(kind) in FULL_KINDS else LINEAR.name


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_compile_for_cuda_routes_every_op_to_its_gpu_backend(family, tmp_path, capsys):
    ckpt, art = tmp_path / "ckpt", tmp_path / "art"
    with open(os.devnull, "w") as quiet:
        init_checkpoint(family, "tiny", seed=3, out_dir=ckpt, log=quiet)
    rc = hgc(["compile", str(ckpt), "-o", str(art), "--target", "cuda", "--no-dumps"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    routing = json.loads((art / "routing.json").read_text())
    assert routing["target"] == "cuda"
    assert all(b["device"] == "cuda" for b in routing["backends"])
    seen: dict[str, set] = {}
    for program, entries in routing["programs"].items():
        assert entries, f"{family}/{program}: no op nodes routed"
        for e in entries:
            want = expected_backend(e["op"], e["kind"])
            assert e["backend"] == want, f"{family}/{program} {e['node']} (layer {e['layer_id']}, {e['kind']}): " \
                                         f"routed to {e['backend']}, expected {want}"
            seen.setdefault(e["backend"], set()).add(e["op"])
            if e["backend"] == LINEAR.name:
                assert LayerKind(e["kind"]) in LINEAR_KINDS
                assert e["backend_capturable"] == [m.value for m in MODES
                                                   if m in (Mode.DECODE, Mode.TARGET_VERIFY)]
    # every family has full-attention and linear layers and routed experts
    assert set(seen) == {FULL.name, LINEAR.name, MOE.name}, f"{family}: backends used {sorted(seen)}"
    lints = json.loads((art / "lints.json").read_text())
    assert lints["counts"]["error"] == 0
    # the linear ops capture where their policy allows: no capture warning names triton_linear
    assert not [f for f in lints["findings"] if f.get("backend") == LINEAR.name], lints["findings"]


def test_the_cuda_backends_declare_every_mode():
    for cap in (FULL, LINEAR, MOE):
        assert cap.device == "cuda" and set(cap.modes_supported) == set(MODES), cap.name
