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
