"""`hgc compile --target cuda` on this CPU machine: routing binds every op to a CUDA backend that serves it.

Nothing runs on a GPU here: the compiler reads each backend class's `capability` declaration
(runtime/backends/__init__.py imports the modules without their kernel libraries), so a CPU
machine can compile for "cuda". The expected names are read from those classes' declarations,
not spelled twice.

- bfloat16, attention head dims FlashInfer builds: full attention to FlashInfer, linear attention
  (and the short conv) to the Triton linear backend, the MoE block to the Triton MoE backend, with
  FlashInfer's kernel options recorded;
- float32 (docs/DESIGN.md failure 9): FlashInfer has no float32 kernels, so MLA goes to the Triton
  MLA kernel, and GQA, which nothing on cuda runs in float32 by itself, fails the compile naming
  the layer, the dtype and each backend considered;
- a head dim FlashInfer does not build fails the compile with the limit;
- `--route` picks another kernel (triton_mla, FlashInfer's paged extend, torch_reference for one layer).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hgc import main as hgc
import torch

from compiler.splitops import FULL_KINDS, LINEAR_KINDS, MODES, LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from compiler.splitops.artifact import DEFAULT_EXTEND_TOKEN_COUNTS, EAGER
from models.families import FAMILY_IDS
from runtime.backends.flashinfer_attention import FlashInferAttentionBackend
from runtime.backends.protocol import BackendSetup
from runtime.backends.torch_reference import TorchReferenceBackend
from runtime.backends.triton_linear import TritonLinearBackend
from runtime.backends.triton_mla import TritonMLABackend
from runtime.backends.triton_moe import TritonMoEBackend
from runtime.cache.state_pool import StatePool
from testkit.helpers import tiny_checkpoint

FULL, LINEAR, MOE, MLA = (FlashInferAttentionBackend.capability, TritonLinearBackend.capability,
                          TritonMoEBackend.capability, TritonMLABackend.capability)
GQA_FAMILIES = ("qwen3_next", "qwen3_5")  # full attention: GQA; the others' is MLA
MLA_FAMILIES = tuple(f for f in FAMILY_IDS if f not in GQA_FAMILIES)
# bailing_linear builds its MLA rotary width from head_dim * partial_rotary_factor (0.5)
RELEASED_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 128}

pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces")


def expected_backend(op: str, kind: str | None) -> str:
    if op == "moe":
        return MOE.name
    return FULL.name if LayerKind(kind) in FULL_KINDS else LINEAR.name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's tiny checkpoint; the GQA families with head_dim 64 (FlashInfer builds no 32), the
    MLA families with the released latent rank 512 and rope width 64 (FlashInfer's MLA takes no other)."""
    root = tmp_path_factory.mktemp("cuda_target")
    for family in GQA_FAMILIES + MLA_FAMILIES:
        extra = {"head_dim": 64} if family in GQA_FAMILIES else RELEASED_MLA
        tiny_checkpoint(family, root / family, seed=3, **extra)
    return root


def compile_cuda(checkpoints, family, tmp_path, capsys, *flags):
    art = tmp_path / f"{family}-art"
    rc = hgc(["compile", str(checkpoints / family), "-o", str(art), "--target", "cuda", "--no-dumps", "--no-inductor", *flags])
    err = capsys.readouterr().err
    return rc, art, err


@pytest.fixture(scope="module")
def plain_compile(checkpoints, tmp_path_factory):
    """get(family, dtype, capsys) -> compile_cuda's (rc, artifact, stderr) of the module's checkpoint with
    no flag but the dtype, compiled once for the module: several tests read the same artifact, and
    none writes to it."""
    root = tmp_path_factory.mktemp("plain")
    made = {}

    def get(family: str, dtype: str, capsys):
        if (family, dtype) not in made:
            made[family, dtype] = compile_cuda(checkpoints, family, root / dtype, capsys, "--dtype", dtype)
        return made[family, dtype]

    return get


def entries(art) -> list[dict]:
    routing = json.loads((art / "routing.json").read_text())
    return [e for program in routing["programs"].values() for e in program]


@pytest.mark.parametrize("family", GQA_FAMILIES + MLA_FAMILIES)
def test_compile_for_cuda_routes_every_op_to_its_gpu_backend(plain_compile, family, capsys):
    rc, art, err = plain_compile(family, "bfloat16", capsys)
    assert rc == 0, err[-3000:]
    routing = json.loads((art / "routing.json").read_text())
    assert routing["target"] == "cuda" and routing["routes"] == []
    assert all(b["device"] == "cuda" for b in routing["backends"])
    seen: dict[str, set] = {}
    linear_options: set[str] = set()
    for program, program_entries in routing["programs"].items():
        assert program_entries, f"{family}/{program}: no op nodes routed"
        for e in program_entries:
            want = expected_backend(e["op"], e["kind"])
            assert e["backend"] == want, f"{family}/{program} {e['node']} (layer {e['layer_id']}, {e['kind']}): " \
                                         f"routed to {e['backend']}, expected {want}"
            assert e["dtype"] == "bfloat16" and e["chosen_by"] == "priority"
            seen.setdefault(e["backend"], set()).add(e["op"])
            if e["backend"] == LINEAR.name:
                assert LayerKind(e["kind"]) in LINEAR_KINDS
                # extend and mixed too where our own kernels run (GDN and Lightning chunks, the conv)
                table_driven = e["op"] in ("gdn_core", "lightning_core", "short_conv", "gdn_fused")
                assert e["backend_capturable"] == [m.value for m in MODES if table_driven
                                                   or m in (Mode.DECODE, Mode.TARGET_VERIFY)], e
            if e["backend"] == FULL.name:  # routing.json says which kernels run: the defaults, spelled out
                assert e["options"] == FULL.resolve_options({})
            if e["backend"] == LINEAR.name:  # every linear op takes the default: our chunk kernels
                assert e["options"]["chunk_impl"] == "triton", e
                linear_options.add(json.dumps(e["options"], sort_keys=True))
    # every family has full-attention and linear layers and routed experts
    assert set(seen) == {FULL.name, LINEAR.name, MOE.name}, f"{family}: backends used {sorted(seen)}"
    # the linear ops of a family resolve their options alike: one Triton linear instance, one step plan
    assert len(linear_options) == 1, linear_options
    # Extend and mixed plans cut only where a kernel plans on the host in the larger steps: attention,
    # and KDA (FLA's chunk kernels); GDN, Lightning and the short conv sit in captured pieces; decode
    # has no gap.
    attention = "mla_attention" if family in MLA_FAMILIES else "gqa_attention"
    kda = ["kda_core"] if "kda_core" in {op for ops in seen.values() for op in ops} else []
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == sorted([attention, *kda])
    assert gap_ops(art, "decode") == []
    lints = json.loads((art / "lints.json").read_text())
    assert lints["counts"]["error"] == 0
    # the linear ops capture where their policy allows: no capture warning names triton_linear, and
    # KDA's bounded capture is a note
    linear = [f for f in lints["findings"] if f.get("backend") == LINEAR.name]
    assert all(f["severity"] == "info" and "hgc.kda_core" in f["message"] for f in linear), linear
    assert bool(linear) == bool(kda)


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_float32_mla_routes_to_the_triton_kernel_not_flashinfer(plain_compile, family, capsys):
    rc, art, err = plain_compile(family, "float32", capsys)
    assert rc == 0, err[-3000:]
    full = [e for e in entries(art) if LayerKind(e["kind"]) in FULL_KINDS and e["op"] == "mla_attention"]
    assert full and {e["backend"] for e in full} == {MLA.name} and {e["dtype"] for e in full} == {"float32"}
    assert json.loads((art / "lints.json").read_text())["counts"]["error"] == 0


@pytest.mark.parametrize("family", GQA_FAMILIES)
def test_float32_gqa_on_cuda_fails_the_compile_naming_layer_dtype_and_backends(checkpoints, family, tmp_path, capsys):
    rc, art, err = compile_cuda(checkpoints, family, tmp_path, capsys, "--dtype", "float32")
    assert rc == 2 and not art.exists()
    assert "node gqa_attention (layer 3, kind full_gqa): no backend on cuda runs hgc.gqa_attention in float32" in err
    assert "considered: flashinfer runs dtypes ['bfloat16', 'float16'], not float32" in err
    assert "--route gqa_attention=torch_reference" in err


def test_float32_gqa_routes_to_flashinfer_with_every_step_on_the_triton_kernels(checkpoints, tmp_path, capsys):
    """FlashInfer's kernels take no float32, the Triton GQA kernels do: routed with extend_impl=triton
    (decode_impl=triton is the default), GQA layers run float32 on the FlashInfer backend, whose
    extends are then captured too; with FlashInfer's decode kernel the route is refused, saying which
    options would take float32."""
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "float32",
                                "--route", "gqa_attention=flashinfer[extend_impl=triton]")
    assert rc == 0, err[-3000:]
    gqa = [e for e in entries(art) if e["op"] == "gqa_attention"]
    assert gqa and {(e["backend"], e["dtype"]) for e in gqa} == {(FULL.name, "float32")}
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == []
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path / "fi", capsys, "--dtype", "float32",
                                "--route", "gqa_attention=flashinfer[extend_impl=triton,decode_impl=flashinfer]")
    assert rc == 2 and not art.exists()
    assert ("flashinfer, which runs dtypes ['bfloat16', 'float16'], not float32 (hgc.gqa_attention runs float32 "
            "with decode_impl=triton, extend_impl=triton)") in err


def test_a_head_dim_flashinfer_does_not_build_fails_the_compile(tmp_path, capsys):
    tiny_checkpoint("qwen3_next", tmp_path / "hd32", seed=3)  # tiny: head_dim 32
    rc, art, err = compile_cuda(tmp_path, "hd32", tmp_path, capsys, "--dtype", "bfloat16")
    assert rc == 2
    assert "(layer 3, kind full_gqa)" in err and "flashinfer q dim -1 is 32, it takes [64, 128, 256]" in err


def test_an_mla_geometry_flashinfer_is_not_checked_at_routes_to_the_triton_kernel(tmp_path, capsys):
    """The tiny MLA geometry (latent rank 32, rope 8) in bf16: the Triton MLA kernel; naming FlashInfer
    for it fails the compile with the limit."""
    tiny_checkpoint("bailing_linear", tmp_path / "r32", seed=3)
    rc, art, err = compile_cuda(tmp_path, "r32", tmp_path, capsys, "--dtype", "bfloat16")
    assert rc == 0, err[-3000:]
    mla = [e for e in entries(art) if e["op"] == "mla_attention"]
    assert mla and {e["backend"] for e in mla} == {MLA.name}
    rc, art, err = compile_cuda(tmp_path, "r32", tmp_path / "forced", capsys, "--dtype", "bfloat16",
                                "--route", "mla_attention=flashinfer")
    assert rc == 2 and not art.exists()
    assert "node mla_attention (layer 3, kind full_mla)" in err and "q_latent dim -1 is 32, it takes [512]" in err


def test_routes_pick_the_other_kernels_and_are_recorded(checkpoints, tmp_path, capsys):
    rc, art, err = compile_cuda(checkpoints, "kimi_linear", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "mla_attention=triton_mla", "--route", "layers=0:torch_reference")
    assert rc == 0, err[-3000:]
    by_node = {e["node"]: e for e in entries(art) if e["layer_id"] != 4}
    assert {e["backend"] for e in by_node.values() if e["op"] == "mla_attention"} == {MLA.name}
    layer0 = [e for e in by_node.values() if e["layer_id"] == 0]
    assert layer0 and {e["backend"] for e in layer0} == {TorchReferenceBackend.capability.name}
    assert {e["chosen_by"] for e in layer0} == {"route layers=0:torch_reference"}
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["compile"]["routes"] == ["mla_attention=triton_mla", "layers=0:torch_reference"]
    # torch_reference captures nothing: layer 0's nodes are eager gaps even in decode, its neighbours not
    split = json.loads((art / "split.json").read_text())["programs"]["main"]["decode"]["pieces"]
    gaps = [n for p in split if p["kind"] == EAGER for n in p["nodes"]]
    assert gaps == [e["node"] for e in layer0]
    assert hgc(["inspect", str(art)]) == 0
    assert "routes: mla_attention=triton_mla layers=0:torch_reference" in capsys.readouterr().out

    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "gqa_attention=flashinfer[extend_impl=paged,decode_backend=fa3,decode_impl=triton]")
    assert rc == 0, err[-3000:]
    gqa = [e for e in entries(art) if e["op"] == "gqa_attention"]
    assert {json.dumps(e["options"], sort_keys=True) for e in gqa} == {json.dumps(
        FULL.resolve_options({"extend_impl": "paged", "decode_backend": "fa3", "decode_impl": "triton"}), sort_keys=True)}
    assert {e["options"]["decode_impl"] for e in gqa} == {"triton"}


def test_the_short_extend_limit_is_a_routing_option_the_backend_is_built_with(checkpoints, tmp_path, capsys):
    """`short_extend_tokens` is chosen at compile time, recorded per node in routing.json, and the
    instance the binder builds from that entry runs with it; a value not offered is refused."""
    route = "gdn_core=triton_linear[short_extend_tokens=32]"
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16", "--route", route)
    assert rc == 0, err[-3000:]
    by_op = {}
    for e in entries(art):
        by_op.setdefault(e["op"], set()).add(e["options"].get("short_extend_tokens"))
    assert by_op["gdn_core"] == {"32"} and by_op["short_conv"] == {"64"}  # the route names one op
    pool = StatePool(LayerRegistry([LayerSpec(0, LayerKind.GDN, state={"x": TensorSpec((2, 4), "float32")})]), 2,
                     torch.device("cpu"))
    built = TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {"short_extend_tokens": "32"}))
    assert built.short_extend_tokens == 32
    # an entry without the option (routed before it was declared) gets the declared default
    assert TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {})).short_extend_tokens == 64

    rc, _, err = compile_cuda(checkpoints, "qwen3_next", tmp_path / "bad", capsys, "--dtype", "bfloat16",
                              "--route", "gdn_core=triton_linear[short_extend_tokens=48]")
    assert rc == 2 and "option short_extend_tokens takes 64|0|16|32|128, not '48'" in err


def test_the_cuda_backends_declare_every_mode():
    for cap in (FULL, LINEAR, MOE, MLA):
        assert cap.device == "cuda" and set(cap.modes_supported) == set(MODES), cap.name


def test_hgc_backends_lists_each_kernel_option_with_its_choices_default_first(capsys):
    """The routing options a --route can name are in the table, not only in --json."""
    assert hgc(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("triton_linear "))
    assert "short_extend_tokens=64|0|16|32|128" in lines[at]
    assert "chunk_impl=triton|fla" in lines[at + 1]
    assert any("kda_graph=off|on" in line for line in lines[at:at + 6])
    at = next(i for i, ln in enumerate(lines) if ln.startswith("flashinfer "))
    assert "extend_impl=ragged|paged|triton" in lines[at] and "(triton: gqa_attention only)" in lines[at + 1]



def gap_ops(art, mode: str) -> list[str]:
    """The ops in the eager gaps of the main program's plan for `mode` (split.json)."""
    by_node = {e["node"]: e for e in json.loads((art / "routing.json").read_text())["programs"]["main"]}
    pieces = json.loads((art / "split.json").read_text())["programs"]["main"][mode]["pieces"]
    return sorted({by_node[n]["op"] for p in pieces if p["kind"] == EAGER for n in p["nodes"]})


def test_chunk_impl_fla_makes_gdn_an_extend_gap_again(checkpoints, tmp_path, capsys):
    """FLA's chunk kernels plan on the host: with chunk_impl=fla the GDN cores are eager gaps in
    extend and mixed steps; the short conv (our kernel either way) stays captured."""
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "gdn_core=triton_linear[chunk_impl=fla]")
    assert rc == 0, err[-3000:]
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == ["gdn_core", "gqa_attention"]


def test_the_triton_extend_route_makes_a_qwen3_next_extend_step_one_captured_piece(checkpoints, plain_compile,
                                                                                    tmp_path, capsys):
    """`--route gqa_attention=flashinfer[extend_impl=triton]`: GQA attention, whose policy leaves extend
    and mixed steps to the routed backend, is captured there (FlashInfer's op capture under that
    choice), so with the GDN cores and the conv on our kernels and the MoE captured, the extend and
    mixed plans of both programs are one captured piece, as decode's. Without the route attention is
    the one gap, captured by FlashInfer in steps of up to whole_extend_tokens (512 by default): split.json
    records that bound and the buckets up to it as whole-step graphs, the larger as pieces, and the
    lint says so in a note that names the route for every size. With whole_extend_tokens=0 the gap is
    never captured: every bucket pieces, and the capture warning names the route."""
    route = "gqa_attention=flashinfer[extend_impl=triton]"
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16", "--route", route)
    assert rc == 0, err[-3000:]
    split = json.loads((art / "split.json").read_text())["programs"]
    assert set(split) == {"main", "draft"}
    for program, plans in split.items():
        for mode in ("decode", "extend", "mixed", "target_verify"):
            assert [p["kind"] for p in plans[mode]["pieces"]] == ["captured"], (program, mode)
    gqa = [e for e in entries(art) if e["op"] == "gqa_attention"]
    assert gqa and {e["options"]["extend_impl"] for e in gqa} == {"triton"}
    assert all(e["backend_capturable"] == [m.value for m in MODES] and e["policy"]["extend"] == "capturable"
               for e in gqa)
    lints = json.loads((art / "lints.json").read_text())
    assert lints["counts"]["error"] == 0 and not [f for f in lints["findings"] if f["rule"] == "backend-cannot-capture"]

    rc, art, err = plain_compile("qwen3_next", "bfloat16", capsys)
    assert rc == 0, err[-3000:]
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == ["gqa_attention"] and gap_ops(art, "decode") == []
    split = json.loads((art / "split.json").read_text())
    for program in ("main", "draft"):
        assert {split["programs"][program][m]["whole_up_to"] for m in ("extend", "mixed")} == {512}
        assert [(r["tokens"], r["graph"]) for r in split["extend_graphs"][program]] == [
            (t, "whole" if t <= 512 else "pieces") for t in DEFAULT_EXTEND_TOKEN_COUNTS]
    gqa = [e for e in entries(art) if e["op"] == "gqa_attention"]
    assert all(e["options"]["whole_extend_tokens"] == "512" and e["options"]["extend_impl"] == "ragged"
               and e["backend_capture_bounds"] == {"extend": 512, "mixed": 512} for e in gqa)
    noted = [f for f in json.loads((art / "lints.json").read_text())["findings"] if f["rule"] == "backend-cannot-capture"]
    assert noted and {f["backend"] for f in noted} == {FULL.name} and {f["severity"] for f in noted} == {"info"}
    assert all("captured in extend and mixed steps of up to 512 tokens (whole_extend_tokens=512)" in f["message"]
               for f in noted)
    assert all(f["fix"] == "route it with flashinfer[extend_impl=triton] for whole-step graphs at every size"
               for f in noted)

    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path / "pieces", capsys, "--dtype", "bfloat16",
                                "--route", "gqa_attention=flashinfer[whole_extend_tokens=0]")
    assert rc == 0, err[-3000:]
    split = json.loads((art / "split.json").read_text())
    assert {r["graph"] for r in split["extend_graphs"]["main"]} == {"pieces"}
    warned = [f for f in json.loads((art / "lints.json").read_text())["findings"]
              if f["rule"] == "backend-cannot-capture"]
    assert warned and {f["backend"] for f in warned} == {FULL.name} and {f["severity"] for f in warned} == {"warning"}
    assert all("cannot be captured in mode(s) extend, mixed" in f["message"] for f in warned)
    assert all(f["fix"] == "route it with flashinfer[extend_impl=triton], which flashinfer can capture there"
               for f in warned)


def test_a_kimi_linear_compile_has_whole_step_graphs_up_to_the_kda_bound(checkpoints, plain_compile, tmp_path,
                                                                          capsys):
    """Kimi's extend gaps, MLA (FlashInfer, the Triton MLA kernel's varlen form up to
    whole_extend_tokens=512) and KDA (the recurrent kernel up to short_extend_tokens=64), are both
    captured in small steps: the extend and mixed plans record the smaller bound, 64, naming KDA;
    the buckets up to it are whole-step graphs, the larger ones pieces with both ops in their gaps.
    routing.json records each node's bound, inspect prints the buckets' graphs. A float32 compile
    (MLA on triton_mla) gets the same bound; with short_extend_tokens=0 KDA is never captured."""
    rc, art, err = plain_compile("kimi_linear", "bfloat16", capsys)
    assert rc == 0, err[-3000:]
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == ["kda_core", "mla_attention"]
    why = "hgc.kda_core on triton_linear (short_extend_tokens=64)"
    split = json.loads((art / "split.json").read_text())
    for mode in ("extend", "mixed"):
        plan = split["programs"]["main"][mode]
        assert (plan["whole_up_to"], plan["whole_why"]) == (64, why), plan
    assert [(r["tokens"], r["graph"]) for r in split["extend_graphs"]["main"]] == [
        (t, "whole" if t <= 64 else "pieces") for t in DEFAULT_EXTEND_TOKEN_COUNTS]
    assert {r["why"] for r in split["extend_graphs"]["main"]} == {f"gaps captured up to 64 tokens: {why}"}
    bounds = {e["op"]: e["backend_capture_bounds"] for e in entries(art) if e["op"] in ("kda_core", "mla_attention")}
    assert bounds == {"kda_core": {"extend": 64, "mixed": 64}, "mla_attention": {"extend": 512, "mixed": 512}}
    assert hgc(["inspect", str(art)]) == 0
    out = capsys.readouterr().out
    assert f"extend graphs (main): 16 32 64 whole-step, 128 256 512 1024 2048 4096 pieces: " \
           f"gaps captured up to 64 tokens: {why}" in out, out

    rc, art, err = plain_compile("kimi_linear", "float32", capsys)
    assert rc == 0, err[-3000:]
    assert {e["backend"] for e in entries(art) if e["op"] == "mla_attention"} == {MLA.name}
    assert json.loads((art / "split.json").read_text())["programs"]["main"]["extend"]["whole_up_to"] == 64

    rc, art, err = compile_cuda(checkpoints, "kimi_linear", tmp_path / "never", capsys, "--dtype", "bfloat16",
                                "--route", "kda_core=triton_linear[short_extend_tokens=0]")
    assert rc == 0, err[-3000:]
    plan = json.loads((art / "split.json").read_text())["programs"]["main"]["extend"]
    assert plan["whole_up_to"] == 0 and "hgc.kda_core on triton_linear cannot be captured in extend" in plan["whole_why"]


def test_kda_graph_takes_kda_out_of_kimis_extend_gaps(checkpoints, tmp_path, capsys):
    """`--route kda_core=triton_linear[kda_graph=on]`: KDA's extends on FLA's graph form are captured
    at every size, so MLA is the one extend gap left and its bound (512) the plans' whole-step
    bound; routing.json records the choice on every KDA node, and the layer's conv shares it."""
    rc, art, err = compile_cuda(checkpoints, "kimi_linear", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "kda_core=triton_linear[kda_graph=on]")
    assert rc == 0, err[-3000:]
    assert gap_ops(art, "extend") == gap_ops(art, "mixed") == ["mla_attention"]
    plan = json.loads((art / "split.json").read_text())["programs"]["main"]["extend"]
    assert plan["whole_up_to"] == 512, plan
    kda = [e for e in entries(art) if e["op"] == "kda_core"]
    assert kda and {e["options"]["kda_graph"] for e in kda} == {"on"}
    assert all("extend" in e["backend_capturable"] for e in kda)


@pytest.mark.parametrize("route", ["mla_attention=flashinfer[extend_impl=triton]",
                                   "layers=2:flashinfer[extend_impl=triton]"])
def test_an_mla_layer_routed_with_the_triton_extend_is_refused(checkpoints, tmp_path, capsys, route):
    """The Triton extend kernel serves GQA layers: FlashInfer scopes extend_impl=triton to
    gqa_attention, so a route giving it to an MLA layer fails the compile naming the layer and the
    choice (a runtime given such an entry refuses it too: test_flashinfer_backend_cpu.py)."""
    rc, art, err = compile_cuda(checkpoints, "kimi_linear", tmp_path, capsys, "--dtype", "bfloat16", "--route", route)
    assert rc == 2 and not art.exists()
    assert (f"node mla_attention (layer 2, kind full_mla): route {route} sends hgc.mla_attention to flashinfer, "
            f"whose extend_impl=triton serves hgc.gqa_attention only, not hgc.mla_attention") in err, err


# -- --batch-invariant ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", GQA_FAMILIES + MLA_FAMILIES)
def test_batch_invariant_sets_every_routed_backends_declared_choices(checkpoints, family, tmp_path, capsys):
    """`hgc compile --batch-invariant`: every node's options hold its backend's batch-invariant
    choices (read from the declarations, not spelled here), the manifest records the setting, and
    the draft program's nodes take them too."""
    from runtime.backends import discover

    table = discover().capability_table()
    rc, art, err = compile_cuda(checkpoints, family, tmp_path, capsys, "--dtype", "bfloat16", "--batch-invariant")
    assert rc == 0, err[-3000:]
    for e in entries(art):
        declared = table[e["backend"]].batch_invariant_for(e["op"])
        assert declared is not None, e
        assert all(e["options"][k] == v for k, v in declared.items()), (e["backend"], e["options"], declared)
    # FlashInfer's MLA kernel splits by the batch: MLA layers go to the Triton MLA kernel instead
    attention = FULL.name if family in GQA_FAMILIES else MLA.name
    assert {e["backend"] for e in entries(art)} == {attention, LINEAR.name, MOE.name}
    assert json.loads((art / "manifest.json").read_text())["compile"]["batch_invariant"] is True
    if family in GQA_FAMILIES:  # the choices differ from the defaults: the setting changed something
        assert all(e["options"]["kv_splits"] == "fixed" for e in entries(art) if e["op"] == "gqa_attention")
        assert FULL.resolve_options({})["kv_splits"] != "fixed"
    if family == "qwen3_next":  # what a user reads: the artifact's setting, and what each backend would set
        assert hgc(["inspect", str(art)]) == 0
        assert "numerics: batch-invariant" in capsys.readouterr().out
        assert hgc(["backends"]) == 0
        out = capsys.readouterr().out
        assert "batch-invariant" in out.splitlines()[0] and "gemm_tiles=fixed" in out and "(gqa_attention only)" in out


def test_batch_invariant_refuses_a_route_that_undoes_it_a_backend_without_it_and_the_cpu(checkpoints, tmp_path, capsys):
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16", "--batch-invariant",
                                "--route", "gqa_attention=flashinfer[kv_splits=auto]")
    assert rc == 2 and not art.exists()
    assert "(layer 3, kind full_gqa): --batch-invariant needs flashinfer[kv_splits=fixed]" in err
    assert "sets kv_splits=auto; fix: drop that option from the route" in err
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16", "--batch-invariant",
                                "--route", "layers=0:torch_reference")
    assert rc == 2 and not art.exists()
    assert "(layer 0, kind gdn): --batch-invariant, and route layers=0:torch_reference names torch_reference, " \
           "which declares no batch-invariant kernels" in err
    rc = hgc(["compile", str(checkpoints / "qwen3_next"), "-o", str(tmp_path / "cpu-art"), "--no-dumps",
              "--batch-invariant"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "cpu-art").exists()
    assert "--batch-invariant is built for --target cuda" in err.strip().splitlines()[0]


def test_batch_invariant_choices_must_be_options_the_backend_offers():
    from compiler.splitops import BackendCapability, CapabilityError

    with pytest.raises(CapabilityError, match="batch-invariant choice tiles=fixed"):
        BackendCapability("b", "cuda", ops=frozenset({"moe"}), options=(("tiles", ("auto",)),),
                          batch_invariant=(("tiles", "fixed"),))
    cap = BackendCapability("b", "cuda", ops=frozenset({"moe", "gqa_attention"}), options=(("tiles", ("auto", "fixed")),),
                            batch_invariant=(("tiles", "fixed"),), batch_invariant_ops=frozenset({"moe"}))
    assert BackendCapability.from_json(cap.to_json()) == cap
    assert cap.batch_invariant_for("moe") == {"tiles": "fixed"} and cap.batch_invariant_for("gqa_attention") is None
    with pytest.raises(CapabilityError, match="batch-invariant ops"):
        dataclasses.replace(cap, batch_invariant_ops=frozenset({"short_conv"}))
    none = dataclasses.replace(cap, batch_invariant=None)
    assert BackendCapability.from_json(none.to_json()).batch_invariant is None


def test_the_one_launch_router_and_gdn_split_are_routing_options_built_from_routing_json(checkpoints, tmp_path,
                                                                                         capsys):
    """`router=one_launch` (triton_moe) and `split_decode=one_launch` (triton_linear's fused GDN mixer)
    are chosen at compile time and recorded per node; the binder's instances run with them; with no
    option they route a token step in the gate-up kernel and split in one launch (the defaults)."""
    from runtime.backends.triton_moe import TritonMoEBackend

    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "moe=triton_moe[router=one_launch]",
                                "--route", "gdn_fused=triton_linear[split_decode=one_launch]")
    assert rc == 0, err[-3000:]
    options = {}
    for e in entries(art):
        options.setdefault(e["op"], set()).add((e["options"].get("router"), e["options"].get("split_decode")))
    assert options["moe"] == {("one_launch", None)} and options["gdn_fused"] == {(None, "one_launch")}
    pool = StatePool(LayerRegistry([LayerSpec(0, LayerKind.GDN, state={"x": TensorSpec((2, 4), "float32")})]), 2,
                     torch.device("cpu"))
    assert TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {"split_decode": "one_launch"})
                                     ).merged_split
    assert TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {})).merged_split, "the default"
    assert not TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {"split_decode": "two_launches"})
                                         ).merged_split
    assert TritonMoEBackend.build(BackendSetup(None, pool, pool.device, (), {"router": "one_launch"})).one_launch_router
    default = TritonMoEBackend.build(BackendSetup(None, pool, pool.device, (), {}))
    assert not default.one_launch_router and default.route_in_experts, "the default routes in the gate-up kernel"


def test_walking_decode_tiles_are_a_routing_option_built_from_routing_json(checkpoints, tmp_path, capsys):
    """`decode_tiles=walk` (triton_linear: decode launches of many tiles on programs walking them) is
    chosen at compile time, recorded on every GDN mixer node, and the binder's instance runs with it."""
    rc, art, err = compile_cuda(checkpoints, "qwen3_next", tmp_path, capsys, "--dtype", "bfloat16",
                                "--route", "gdn_fused=triton_linear[decode_tiles=walk]")
    assert rc == 0, err[-3000:]
    tiles = {e["options"].get("decode_tiles") for e in entries(art) if e["op"] == "gdn_fused"}
    assert tiles == {"walk"}
    pool = StatePool(LayerRegistry([LayerSpec(0, LayerKind.GDN, state={"x": TensorSpec((2, 4), "float32")})]), 2,
                     torch.device("cpu"))
    walker = TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {"decode_tiles": "walk"}))
    assert walker.walk_tiles and not walker.fixed_tiles
    assert not TritonLinearBackend.build(BackendSetup(None, pool, pool.device, (), {})).walk_tiles
