"""The loader refuses each damaged artifact with a message naming the file and what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.artifact.loader import LoadError, load_artifact
from testkit.helpers import edit_manifest, edit_routing, shared_artifact

pytestmark = pytest.mark.usefixtures("shared_loads")  # each case loads the intact copy first


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The test run's tiny bailing_linear (testkit/helpers.shared_artifact): each test damages a copy."""
    return shared_artifact(tmp_path_factory, "bailing_linear")[1]


def flip_a_weight_byte(art):
    path = art / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def break_weights_header(art):
    """The header's length field made absurd: safetensors cannot parse the file. The hash, checked
    beside the reads, is still the error reported."""
    path = art / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def truncate_graph(art):
    path = art / "graph.pt2"
    path.write_bytes(path.read_bytes()[:-200])


def drop_manifest(art):
    (art / "manifest.json").unlink()


def edit_routing_bytes(art):
    path = art / "routing.json"
    path.write_text(path.read_text().replace("cpu_reference", "cpu_referencf", 1))


def unknown_format_version(art):
    path = art / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 999
    path.write_text(json.dumps(doc))


def older_moe_schema(art):
    """An artifact traced when hgc.moe had no shared-expert arguments (sealed by that compiler)."""
    def older(doc):
        doc["op_schemas"]["moe"] = doc["op_schemas"]["moe"].replace("Tensor? shared_w13, Tensor? shared_w2, "
                                                                     "Tensor? shared_gate, ", "")
        return doc
    edit_manifest(art, older)


def hand_edited_family(art):
    """A field of manifest.json edited by hand, not resealed: the seal catches it."""
    path = art / "manifest.json"
    doc = json.loads(path.read_text())
    doc["family"] = "qwen3_next"
    path.write_text(json.dumps(doc))


def manifest_field(path: str, value):
    """The manifest with one field set (a dotted path), sealed again: only a cross-check can see it."""
    def damage(art):
        def edit(doc):
            *parents, last = path.split(".")
            target = doc
            for key in parents:
                target = target[key]
            target[last] = value(target[last]) if callable(value) else value
            return doc
        edit_manifest(art, edit)
    damage.__name__ = f"manifest_{path.replace('.', '_')}"
    return damage


def drop_draft_program(art):
    edit_manifest(art, lambda doc: {**doc, "programs": {"main": doc["programs"]["main"]}})


def routing_kind_edited(art):
    edit_routing(art, lambda e: {**e, "kind": "gdn"} if e["layer_id"] == 0 else e)


@pytest.mark.parametrize("damage, message", [
    (flip_a_weight_byte, r"weights.safetensors.*(SHA-256|modified)"),
    (break_weights_header, r"weights.safetensors: SHA-256 .* does not match manifest.json"),
    (truncate_graph, r"graph.pt2.*(SHA-256|modified)"),
    (drop_manifest, r"manifest.json"),
    (edit_routing_bytes, r"routing.json.*(SHA-256|modified)"),
    (unknown_format_version, r"format"),
    (older_moe_schema, r"other hgc op schemas \(moe changed.*recompile"),
    (hand_edited_family, r"manifest.json: its content does not match its manifest_sha256"),
    (manifest_field("model.vocab_size", 1 << 20), r"model.vocab_size is 1048576, the main program's embedding says 320"),
    (manifest_field("model.hidden_size", 65), r"model.hidden_size is 65, the main program's embedding says 64"),
    (manifest_field("config.vocab_size", 100), r"config vocab_size is 100, the main program's embedding says 320"),
    (manifest_field("config.num_hidden_layers", 9), r"config num_hidden_layers is 9, the registry has 4 main layers"),
    (drop_draft_program, r"field 'programs' is \['main'\], but the registry has 1 draft layer"),
    (routing_kind_edited, r"routing.json: main node \w+ is layer 0 of kind 'gdn'; the registry says lightning"),
])
def test_damaged_artifact_is_refused(artifact, tmp_path, damage, message):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    load_artifact(art)  # the intact copy loads
    damage(art)
    with pytest.raises(LoadError, match=message):
        load_artifact(art)
