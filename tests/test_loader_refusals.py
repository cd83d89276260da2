"""The loader refuses each damaged artifact with a message naming the file and what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from compiler.cli import main
from models.loader import init_checkpoint
from runtime.loader import LoadError, load_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    ckpt = init_checkpoint("bailing_linear", "tiny", seed=4, out_dir=tmp_path_factory.mktemp("c") / "c",
                           log=open(os.devnull, "w"))
    out = tmp_path_factory.mktemp("a") / "a"
    assert main(["compile", str(ckpt), "-o", str(out)]) == 0
    return out


def flip_a_weight_byte(art):
    path = art / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def truncate_graph(art):
    path = art / "graph.pt2"
    path.write_bytes(path.read_bytes()[:-200])


def drop_manifest(art):
    (art / "manifest.json").unlink()


def edit_routing(art):
    path = art / "routing.json"
    path.write_text(path.read_text().replace("cpu_reference", "cpu_referencf", 1))


def unknown_format_version(art):
    path = art / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 999
    path.write_text(json.dumps(doc))


def older_moe_schema(art):
    """An artifact traced when hgc.moe had no shared-expert arguments."""
    path = art / "manifest.json"
    doc = json.loads(path.read_text())
    doc["op_schemas"]["moe"] = doc["op_schemas"]["moe"].replace("Tensor? shared_w13, Tensor? shared_w2, "
                                                                 "Tensor? shared_gate, ", "")
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage, message", [
    (flip_a_weight_byte, r"weights.safetensors.*(SHA-256|modified)"),
    (truncate_graph, r"graph.pt2.*(SHA-256|modified)"),
    (drop_manifest, r"manifest.json"),
    (edit_routing, r"routing.json.*(SHA-256|modified)"),
    (unknown_format_version, r"format"),
    (older_moe_schema, r"other hgc op schemas \(moe changed.*recompile"),
])
def test_damaged_artifact_is_refused(artifact, tmp_path, damage, message):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    load_artifact(art)  # the intact copy loads
    damage(art)
    with pytest.raises(LoadError, match=message):
        load_artifact(art)
