"""benchmarks/kernels/step_account.py: its byte and FLOP arithmetic against hand-computed numbers, the
attribution of a traced node's work to its label, the kernel-sequence matching, and the dry run
(CPU, tiny: qwen3_next and kimi_linear, an MLA family) producing both tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from account_cost import attention_cost, attention_pairs, gemm_cost, linear_core_flops, moe_cost  # noqa: E402
from account_trace import StepFacts, align, labelled, node_label, per_call  # noqa: E402


def test_a_projection_reads_its_weight_once():
    # x [1, 2048] @ W[4096, 2048]^T in bf16
    c = gemm_cost(1, 4096, 2048, weight_itemsize=2, act_itemsize=2)
    assert c["weights"] == 4096 * 2048 * 2 == 16_777_216
    assert c["flops"] == 2 * 4096 * 2048
    assert c["bytes"] == 16_777_216 + (2048 + 4096) * 2


def test_gqa_decode_reads_every_cached_key_and_writes_the_new_one():
    # two requests with 64 and 100 cached tokens, one new token each; 2 KV heads of 256, k and v, bf16
    per_token = 2 * 256 * 2 * 2
    c = attention_cost([1, 1], [64, 100], heads=16, key_width=256, value_width=256, kv_bytes_per_token=per_token,
                       act_bytes=0)
    assert c["kv"] == per_token * (2 + 65 + 101) == 344_064  # 2 written, 65 + 101 read
    assert attention_pairs([1, 1], [64, 100]) == 65 + 101
    assert c["flops"] == 2 * 166 * 16 * 512


def test_extend_attention_is_causal():
    assert attention_pairs([512], [0]) == 512 * 513 // 2
    assert attention_pairs([4, 2], [10, 0]) == (4 * 10 + 10) + 3


def test_moe_touches_top_k_experts_at_batch_1_and_every_expert_at_batch_128():
    E, k, D, inter = 16, 4, 64, 32
    per_expert = 3 * inter * D * 2  # gate and up rows [2I, D], down [D, I], bf16
    router = E * D * 2
    one = moe_cost(1, D, inter, E, k, weight_itemsize=2, act_itemsize=2)
    many = moe_cost(128, D, inter, E, k, weight_itemsize=2, act_itemsize=2)
    assert one["weights"] == router + 4 * per_expert == 51_200
    assert many["weights"] == router + 16 * per_expert == 198_656
    assert one["flops"] == 2 * (E * D + k * 3 * inter * D)
    shared = moe_cost(1, D, inter, E, k, 2, 2, shared=48, shared_gate=True)
    assert shared["weights"] - one["weights"] == (3 * 48 * D + D) * 2


def test_linear_core_flops_decode_and_chunks():
    assert linear_core_flops("gdn", [1, 1], heads=2, dk=4, dv=4) == 2 * 2 * 6 * 16
    assert linear_core_flops("lightning", [1], heads=1, dk=4, dv=4) == 4 * 16
    # 128 tokens: per token 3 * 2 dk dv with the delta rule, and 2 * 64 * (dk + dv) twice
    assert linear_core_flops("gdn", [128], heads=1, dk=4, dv=4) == 128 * (6 * 16 + 4 * 64 * 8)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 48, bias=False)

    def forward(self, x):
        return torch.nn.functional.silu(self.proj(x)) * 2


def test_a_traced_node_costs_its_concrete_tensors_under_its_label():
    block = _Block()
    gm = torch.export.export(block, (torch.randn(5, 32),)).module()
    labels = {n: node_label(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert ("-", "gemm proj") in labels.values()
    facts = StepFacts([5], [0], {}, {}, {block.proj.weight.data_ptr(), gm.proj.weight.data_ptr()})
    costs: dict = {}
    x = torch.randn(5, 32)
    with labelled(gm, labels, costs, facts):
        out = gm(x)
    assert torch.allclose(out, block(x))  # the labelled run computes what the module does
    gemm = costs[("-", "gemm proj")]
    assert gemm["weights"] == 48 * 32 * 4 and gemm["flops"] == 2 * 5 * 48 * 32
    assert gemm["bytes"] == 48 * 32 * 4 + (5 * 32 + 5 * 48) * 4
    glue = costs[("-", "glue")]  # silu, then * 2: each reads and writes [5, 48] float32
    assert glue["flops"] == 0 and glue["bytes"] == 0 and glue["unfused"] == 4 * 5 * 48 * 4
    assert "forward" not in gm.__dict__  # the module's own forward is back


def test_align_labels_the_replay_by_its_eager_twin():
    eager = [{"name": n, "us": 1.0, "label": ("0", op), "via": "link"} for n, op in (("mm", "gemm q"), ("norm", "glue"),
                                                                       ("attn", "gqa_attention"))]
    timed = [{"name": n, "us": 2.0, "label": None} for n in ("copy", "mm", "norm", "attn_v2")]
    match = align(timed, eager)
    assert [k["label"][1] for k in timed] == ["unmatched", "gemm q", "glue", "gqa_attention"]
    assert match == {"kernels": 4, "eager_kernels": 3, "eager_labelled": {"link": 3}, "matched_by_name": 2,
                     "matched_by_position": 1, "unmatched": 1}


def test_per_call_means_equal_calls_and_keeps_the_last_of_unequal_ones():
    a = [{"name": "k", "us": 1.0, "label": None}, {"name": "j", "us": 3.0, "label": None}]
    b = [{"name": "k", "us": 3.0, "label": None}, {"name": "j", "us": 5.0, "label": None}]
    mean, how = per_call([a, b])
    assert [k["us"] for k in mean] == [2.0, 4.0] and how == "mean over 2 calls"
    last, how = per_call([a, b[:1]])
    assert last == b[:1] and "differ" in how


@pytest.mark.slow
def test_dry_run_gives_both_tables_for_qwen3_next_and_kimi_linear(tmp_path, tmp_path_factory):
    from testkit.helpers import shared_artifact

    # the load stage finds the test run's tiny artifacts there (their own names), compiled once for every module
    for family in ("qwen3_next", "kimi_linear"):
        work = shared_artifact(tmp_path_factory, family)[1].parent
    cmd = [sys.executable, "benchmarks/kernels/step_account.py", "--dry-run", "--out", str(tmp_path),
           "--work", str(work), "--family", "qwen3_next,kimi_linear", "--batches", "1", "--extends", "16",
           "--replays", "1", "--iters", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "step_account.json").read_text())
    # qwen3_next's GDN mixers are one fused op each on the CPU (compiler/passes/fusion.py)
    for family, attention, core in (("qwen3_next", "gqa_attention", {"gdn_fused"}),
                                    ("kimi_linear", "mla_attention", {"kda_core", "short_conv"})):
        rec = doc["families"][family]
        assert all(s["status"] == "ok" for s in rec["stages"].values()), rec["stages"]
        decode, extend = rec["decode"]["1"], rec["extend"]["16"]
        for r in (decode, extend):
            whats = {g["what"] for g in r["summary"]["groups"]}
            assert {"moe", attention, *core} <= whats and any(w.startswith("gemm ") for w in whats)
            labelled_share = sum(k["label"][1] != "unmatched" for k in r["kernels"]) / len(r["kernels"])
            assert labelled_share > 0.9, labelled_share
            assert r["summary"]["bytes"] > 0 and r["summary"]["floor_ms"] > 0
        kv = next(c for c in decode["costs"] if c["what"] == attention)["kv"]
        assert kv > 0  # 64 cached tokens read, one written
        assert extend["summary"]["flops"] > decode["summary"]["flops"]
    text = (tmp_path / "step_account.md").read_text()
    assert text.count("decode B=1") == 2 and text.count("extend 16 tokens") == 2
    assert "not judged" in text



def refusal(capsys, *argv: str) -> str:
    """step_account's main in this process (a usage error comes before any work): exit 2, its stderr."""
    from step_account import main

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_synchronising_call_is_reported_at_the_project_line_under_it(monkeypatch):
    """timeline's sync sites: the innermost frame of runtime/ (or compiler/, models/) under torch's
    warning, counted per site; a warning with no project frame under it keeps its own location; other
    warnings are no sync sites. The CPU build has no sync debug mode: stand-ins warn as torch's does."""
    import warnings

    import account_trace
    from runtime.step import host_copy

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: warnings.warn("called a synchronizing CUDA operation"))
    copy = host_copy.HostCopy(torch.arange(3))

    def step():
        copy.tolist()  # runtime/step/host_copy.py reads the host copy: the site to name
        copy.tolist()
        warnings.warn("called a synchronizing CUDA operation")  # no project frame under it
        warnings.warn("something else")

    sites = account_trace._sync_sites(step)
    assert modes == ["warn", 0]
    assert len(sites) == 2, sites
    assert "runtime/step/host_copy.py:" in sites[0] and sites[0].endswith("(x2)"), sites
    assert "tests/benchmarks/test_step_account.py:" in sites[1] and sites[1].endswith("(x1)"), sites


def test_compiled_bundles_of_two_families_are_refused_before_any_work(tmp_path, capsys):
    """A compiled bundle points FlashInfer's module cache at its own copy before FlashInfer is imported,
    so a second family's bundle cannot load in the process: the run is refused in one line, up front."""
    err = refusal(capsys, "--dry-run", "--out", str(tmp_path / "o"), "--family", "qwen3_next,kimi_linear",
                  "--compiled-pieces")
    assert "--compiled-pieces: one family per run" in err, err[-2000:]
    assert not (tmp_path / "o").exists()


def test_timeline_stacks_without_timeline_is_refused(tmp_path, capsys):
    err = refusal(capsys, "--dry-run", "--out", str(tmp_path / "o"), "--timeline-stacks")
    assert "--timeline-stacks: " in err and "--timeline too" in err, err[-2000:]
    assert not (tmp_path / "o").exists()
