"""`hgc lint` on the published Qwen3-Next-80B-A3B and Qwen3.6-27B configs (the two largest layouts):
no weights, under 30 s each, no errors, routing table equal to the published layer layout.
"""

from __future__ import annotations

import pytest

from tests.compiler.test_compiler_configs import expected_layout, lint_published

pytestmark = pytest.mark.slow  # two exports of 48- and 64-layer models: about 40 s on 2 cores


@pytest.mark.parametrize("name", ["qwen3_next_80b_a3b", "qwen3_6_27b"])
def test_lint_published_config(name, tmp_path, capsys):
    doc = lint_published(name, tmp_path, capsys)
    assert doc["family"] == {"qwen3_next_80b_a3b": "qwen3_next", "qwen3_6_27b": "qwen3_5"}[name]
    if name == "qwen3_6_27b":  # its MTP layer: a draft full-attention layer with its own id after the main ones
        draft = [r for r in doc["layers"] if r["program"] == "draft"]
        assert [r["layer"] for r in draft] == [64]
    assert len(expected_layout(name)[0]) in (48, 64)
