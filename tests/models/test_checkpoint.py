"""Checkpoint files: init-model output, sharded indexes, and bad checkpoints that must name the
file and the field or tensor at fault. Family-specific config checks live in each family's tests."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hgc import main
from models.checkpoint import INDEX_NAME, CheckpointReader
from models.common import CheckpointError
from models.families import FAMILY_IDS
from models.loader import init_checkpoint, load_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "qwen3_next-tiny"
    init_checkpoint("qwen3_next", "tiny", 0, out, shard_bytes=None)
    return out


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_init_model_is_seeded_and_loads_back(family, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_checkpoint(family, "tiny", 3, a, shard_bytes=None)
    init_checkpoint(family, "tiny", 3, b, shard_bytes=None)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    _, _, model = load_checkpoint(a)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_sharded_checkpoint_with_index_loads_the_same_weights(tiny, tmp_path):
    sharded = tmp_path / "sharded"
    assert main(["init-model", "--family", "qwen3_next", "--size", "tiny", "--seed", "0", "-o", str(sharded),
                 "--shard-mb", "0.05"]) == 0
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, _, one = load_checkpoint(tiny)
    _, _, many = load_checkpoint(sharded)
    for (n1, t1), (n2, t2) in zip(one.state_dict().items(), many.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: missing"):
        load_checkpoint(tmp_path)


def test_unreadable_config(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(line 1"):
        load_checkpoint(ckpt)


def test_unknown_model_type(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: unknown model_type 'llama'"):
        load_checkpoint(ckpt)


def _rewrite_tensors(ckpt, edit):
    reader = CheckpointReader(ckpt)
    tensors = {n: reader.get(n) for n in reader.names()}
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    _rewrite_tensors(ckpt, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.norm.weight'"):
        load_checkpoint(ckpt)


def test_extra_tensor(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    _rewrite_tensors(ckpt, lambda t: t.update({"model.layers.99.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: unexpected tensor 'model.layers.99.bogus.weight'"):
        load_checkpoint(ckpt)


def test_misshaped_tensor(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    _rewrite_tensors(ckpt, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \[3\], expected"):
        load_checkpoint(ckpt)


def test_truncated_safetensors(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        load_checkpoint(ckpt)


def test_truncated_header(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"model.safetensors: "):
        load_checkpoint(ckpt)


def test_index_pointing_at_a_missing_shard(tiny, tmp_path):
    ckpt = copy(tiny, tmp_path)
    (ckpt / INDEX_NAME).write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: missing"):
        load_checkpoint(ckpt)


def test_cli_reports_bad_checkpoint_in_one_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "config.json: missing" in err and "Traceback" not in err


def test_cli_generate_json(tiny, capsys):
    assert main(["generate", str(tiny), "--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [o["prompt_ids"] for o in doc["outputs"]] == [[1, 2, 3], [4, 5]]
    assert all(len(o["output_ids"]) == 3 for o in doc["outputs"])


@pytest.mark.parametrize("bad", ["1,x", "1,2;", "-1"])
def test_cli_rejects_bad_prompt_ids(tiny, bad, capsys):
    assert main(["generate", str(tiny), "--prompt-ids", bad, "--max-new-tokens", "2"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_cli_rejects_token_outside_vocabulary(tiny, capsys):
    assert main(["generate", str(tiny), "--prompt-ids", "1,99999999", "--max-new-tokens", "2"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_published_mtp_tensors_are_left_unread_without_a_draft_field(tmp_path):
    """Qwen3-Next's published config enables no draft but the checkpoint carries mtp.*: that loads."""
    from models.families import get_family
    from models.checkpoint import write_checkpoint
    fam = get_family("qwen3_next")
    cfg = fam.make_config("tiny")
    cfg.pop("num_nextn_predict_layers", None)
    cfg.pop("mtp_num_hidden_layers", None)
    with_draft = dict(cfg, num_nextn_predict_layers=1)
    model = fam.build(fam.text_config(with_draft))
    fam.init_weights(model, 0)
    tensors = model.checkpoint_tensors()
    assert any(n.startswith("mtp.") for n in tensors)
    write_checkpoint(tmp_path / "c", cfg, tensors)
    _, _, loaded = load_checkpoint(tmp_path / "c")
    assert not loaded.layer_registry.draft_layers()
    # Any other stray tensor is still an error.
    write_checkpoint(tmp_path / "d", cfg, dict(tensors, **{"model.stray": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.stray'"):
        load_checkpoint(tmp_path / "d")
