"""`hgc lint` on the published Kimi-Linear and Ring-mini-linear configs: no weights, under 30 s, no
errors, and the routing table follows the published layer layout. The configs are the repo's copies
in tests/configs/ (public files; see tests/configs/SOURCES.md for where each came from).
The Qwen configs are in test_compiler_configs_qwen.py (two files keep each under a minute).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from hgc import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def expected_layout(name: str) -> tuple[list[str], list[str]]:
    """(kind of each main layer, kinds of the draft layers), read from the published config itself."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    if name == "qwen3_next_80b_a3b":
        n, every = cfg["num_hidden_layers"], cfg["full_attention_interval"]
        return ["full_gqa" if (i + 1) % every == 0 else "gdn" for i in range(n)], []
    if name == "qwen3_6_27b":
        text = cfg["text_config"]
        kinds = {"full_attention": "full_gqa", "linear_attention": "gdn"}
        return [kinds[t] for t in text["layer_types"]], ["full_gqa"] * int(text.get("mtp_num_hidden_layers", 0))
    if name == "kimi_linear_48b_a3b":
        full = {i - 1 for i in cfg["linear_attn_config"]["full_attn_layers"]}  # 1-based in the config
        return ["full_mla" if i in full else "kda" for i in range(cfg["num_hidden_layers"])], []
    if name == "ring_mini_linear_2_0":
        group = cfg["layer_group_size"]
        return ["full_gqa" if (i + 1) % group == 0 else "lightning" for i in range(cfg["num_hidden_layers"])], []
    raise KeyError(name)


def lint_published(name: str, tmp_path, capsys) -> dict:
    shutil.copy(CONFIGS / f"{name}.json", tmp_path / "config.json")
    start = time.perf_counter()
    code = main(["lint", str(tmp_path), "--json"])
    seconds = time.perf_counter() - start
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, doc["findings"]
    # about 20 s alone on 2 cores; the bound catches a lint that rebuilds or traces the whole model
    # (minutes), with room for a machine busy with the rest of the suite
    assert seconds < 120, f"hgc lint of {name} took {seconds:.1f} s (limit 120 s)"
    assert doc["counts"]["error"] == 0 and doc["findings"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"], "lint wrote files"
    main_kinds, draft_kinds = expected_layout(name)
    rows = doc["layers"]
    assert [r["kind"] for r in rows if r["program"] == "main"] == main_kinds
    assert [r["layer"] for r in rows if r["program"] == "main"] == list(range(len(main_kinds)))
    assert [r["kind"] for r in rows if r["program"] == "draft"] == draft_kinds
    assert {r["backend"] for r in rows} == {"cpu_reference"}
    registry_kinds = [l["kind"] for l in doc["registry"] if not l["draft"]]
    assert registry_kinds == main_kinds
    return doc


@pytest.mark.parametrize("name", ["kimi_linear_48b_a3b", "ring_mini_linear_2_0"])
def test_lint_published_config(name, tmp_path, capsys):
    doc = lint_published(name, tmp_path, capsys)
    assert doc["family"] == {"kimi_linear_48b_a3b": "kimi_linear", "ring_mini_linear_2_0": "bailing_linear"}[name]


def test_kimi_layer_ids_are_normalised_from_one_based():
    kinds, _ = expected_layout("kimi_linear_48b_a3b")
    assert [i for i, k in enumerate(kinds) if k == "full_mla"] == [3, 7, 11, 15, 19, 23, 26]
