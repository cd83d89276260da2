"""benchmarks/tune_moe: which config a bucket keeps (a tuned one only when the whole op is more than
MIN_GAIN faster than the default's), and `--reselect` applying that to a file's recorded times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

from tune_moe import MIN_GAIN, main, pick_winner  # noqa: E402

from runtime.backends.kernels.moe_config import default_config, load_config_table  # noqa: E402


def test_a_tuned_config_wins_only_by_more_than_the_noise_margin():
    assert pick_winner({"token": 34.70, "sorted_bm16": 41.3, "default": 34.72}) == "default"
    assert pick_winner({"token": 34.72 * (1 - 2 * MIN_GAIN), "default": 34.72}) == "token"
    assert pick_winner({"token": 30.0, "sorted_bm16": 29.0}) == "sorted_bm16"  # the default failed to run


def test_reselect_puts_the_default_back_where_the_tuned_gain_is_noise(tmp_path, capsys):
    E, I, D, k = 512, 256, 2048, 10
    tuned = {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 2048, "GROUP_M": 1, "num_warps": 8, "num_stages": 1}
    down = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 8, "num_stages": 1}
    doc = {"meta": {"E": E, "I": I, "D": D, "top_k": k},
           "buckets": {"1": {"gate_up": tuned, "down": down, "winner": "token", "us": 34.70,
                             "whole_us": {"token": 34.70, "default": 34.72}},
                       "8": {"gate_up": tuned, "down": down, "winner": "token", "us": 84.67,
                             "whole_us": {"token": 84.67, "default": 96.32}}}}
    path = tmp_path / f"E={E},I={I},device=cpu.json"
    path.write_text(json.dumps(doc))
    assert main(["--reselect", str(path)]) == 0
    table = load_config_table(path)
    assert table[1] == default_config(1, E, I, D, k)  # 0.06% faster: noise
    assert table[8].down.BLOCK_N == 16 and table[8].gate_up.num_warps == 8  # 12% faster: kept
    saved = json.loads(path.read_text())["buckets"]
    assert saved["1"]["winner"] == "default" and saved["1"]["us"] == 34.72 and saved["8"]["winner"] == "token"
    assert "bucket 1: the default" in capsys.readouterr().out


def test_the_wide_search_fits_shared_memory_and_keeps_blocks_within_the_reduction():
    from tune_moe import WIDE_BLOCK_N, _fits, wide_pipelines, wide_tiles
    for stage, depth, bm in (("gate_up", 2048, 16), ("down", 512, 16), ("down", 64, 16), ("gate_up", 2048, 128),
                             ("down", 512, 128)):
        tiles = wide_tiles(stage, bm, depth, 2)
        assert tiles and len(set(tiles)) == len(tiles)
        assert {c.BLOCK_N for c in tiles} <= set(WIDE_BLOCK_N[stage]) and all(c.BLOCK_K <= depth for c in tiles)
        around = wide_pipelines(tiles[-1], 2)
        assert {(c.BLOCK_N, c.BLOCK_K) for c in around} == {(tiles[-1].BLOCK_N, tiles[-1].BLOCK_K)}
        assert all(_fits(c, 2) for c in tiles + around) and len(around) > 5


def test_the_stage_reference_sums_to_the_cpu_oracle():
    """The per-pair h and weighted y every tuning candidate is checked against add up, over each
    token's slots, to moe_reference: routed experts and a gated shared expert of two chunks, the
    second masked past its 40 channels."""
    import torch
    from tune_moe import StageReference
    from runtime.backends.cpu_reference import moe_reference, route_topk
    g = torch.Generator().manual_seed(5)
    T, E, k, Dm, I, S = 6, 8, 2, 32, 24, 40
    x = torch.randn(T, Dm, generator=g)
    router, gate = torch.randn(E, Dm, generator=g), torch.randn(1, Dm, generator=g)
    layer = (router, None, torch.randn(E, 2 * I, Dm, generator=g), torch.randn(E, Dm, I, generator=g),
             torch.randn(2 * S, Dm, generator=g), torch.randn(Dm, S, generator=g), gate)
    rids, rw = route_topk(x, router, None, k, "softmax", True, 1.0, 1, 1)
    g_w = torch.sigmoid(x @ gate[0])[:, None].expand(T, 2)
    ids = torch.cat([rids, torch.tensor([[E, E + 1]] * T)], 1).to(torch.int32)
    ids[-1] = E + 2  # a padding token: the sentinel in every slot
    weights = torch.cat([rw, g_w], 1)
    ref = StageReference(x, layer, ids, weights, 2, I)
    want = moe_reference(x, *layer, k, "softmax", True, 1.0, 1, 1)
    got = ref.y.view(T, 4, Dm).sum(1)
    assert torch.allclose(got[:-1], want[:-1], rtol=1e-4, atol=1e-4) and (got[-1] == 0).all()


def test_a_run_over_some_buckets_keeps_the_files_other_buckets(tmp_path, monkeypatch):
    import tune_moe
    from moe_layers import Bench
    from runtime.backends.kernels.moe_config import config_file_name
    E, k = 16, 4
    bench = Bench(True)
    old = {str(t): {**default_config(t, E, bench.I, bench.D, k).to_dict(), "us": 1.0} for t in (1, 8, 256)}
    path = tmp_path / config_file_name(E, bench.I, "cpu")
    path.write_text(json.dumps({"meta": {"date": "then", "command": "before"}, "buckets": old}))
    new = default_config(64, E, bench.I, bench.D, k)
    seen = {}

    def tuned(bench, E, top_k, buckets, deadline, log, known, wide_to):
        seen.update(known)
        return {str(t): {**new.to_dict(), "source": "tuned"} for t in buckets}

    monkeypatch.setattr(tune_moe, "tune_shape", tuned)
    tune_moe.tune_all(bench, {"e16": dict(E=E, top_k=k)}, tmp_path, tmp_path / "out", 1.0, buckets=[8, 32])
    doc = json.loads(path.read_text())
    assert list(doc["buckets"]) == ["1", "8", "32", "256"]
    assert doc["buckets"]["1"] == old["1"] and doc["buckets"]["256"] == old["256"]
    assert load_config_table(path)[8] == new and load_config_table(path)[32] == new
    assert doc["meta"]["kept_buckets"] == {"buckets": [1, 256], "date": "then", "command": "before"}
    assert seen[8] == default_config(8, E, bench.I, bench.D, k), "the file's entry is offered to the search"
