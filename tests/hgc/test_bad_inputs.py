"""Every command refuses bad input the same way: one exit-code scheme, a short message naming the
culprit, no traceback, and nothing written or changed on disk.

One tiny checkpoint and one artifact (compiled with linked weights beside a copied one) serve the
whole table; damaged copies are made once. Each case calls `hgc`'s main in this process with its
argv and checks, against the README's table (0 ok, 2 bad input or usage, 1 runtime failure, 130
interrupted):

- the exit code;
- stderr: at most three lines, the first `hgc COMMAND: ...`, naming the flag, file, field, tensor
  or layer at fault (a pattern per case), and no traceback;
- the work folder's tree (names, sizes, contents' hashes) the same before and after.

The HTTP endpoints' bad requests are in tests/server/test_server_edges.py.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hgc import main
from hgc.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from testkit.helpers import edit_manifest, shared_artifact

# the cases compile one config, and load its artifact, again and again
pytestmark = pytest.mark.usefixtures("shared_traces", "shared_loads")

FAMILY = "qwen3_next"
POSITIONS = 262144  # the tiny qwen3_next's max_position_embeddings


# SHA-256 of a file by its path and status: (inode, size, mtime, ctime) -> digest. Every write or
# metadata change of a file moves its ctime, which no process can set back, so a file whose status
# is unchanged has the content it was hashed with (the work folder is hashed twice a case).
_DIGESTS: dict[tuple, str] = {}
_SETTLED_NS = 1_000_000_000  # a ctime this old cannot share its clock tick with a later change


def sha256_of(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _DIGESTS.get(key)
    if digest is None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if time.time_ns() - st.st_ctime_ns > _SETTLED_NS:
            _DIGESTS[key] = digest
    return digest


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under root: folders as 'dir', files as their SHA-256."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else sha256_of(path)
    return out


def _rewrite_tensor(ckpt: Path, edit) -> None:
    """Rewrite the checkpoint's (single) safetensors file with `edit(tensors)` applied."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The folder every case runs in: checkpoints, artifacts and their damaged copies."""
    w = tmp_path_factory.mktemp("bad_inputs")
    # the tiny checkpoint and compile every module of the test run reuses (testkit/helpers.shared_artifact),
    # copied here: the cases read and damage these copies, never the originals
    shared_ckpt, shared_art = shared_artifact(tmp_path_factory, FAMILY)
    ckpt = shutil.copytree(shared_ckpt, w / "ckpt")
    shutil.copytree(shared_art, w / "art")
    shutil.copytree(ckpt, w / "linked_ckpt")
    assert main(["compile", str(w / "linked_ckpt"), "-o", str(w / "linked_art"), "--no-dumps", "--link-weights",
                 "-q"]) == 0

    # checkpoints
    shutil.copytree(ckpt, w / "int32_ckpt")
    _rewrite_tensor(w / "int32_ckpt", lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    shutil.copytree(ckpt, w / "missing_tensor_ckpt")
    _rewrite_tensor(w / "missing_tensor_ckpt", lambda t: t.pop("model.norm.weight"))
    (w / "config_only").mkdir()
    shutil.copy(ckpt / "config.json", w / "config_only" / "config.json")
    shutil.copytree(ckpt, w / "bad_json_ckpt")
    (w / "bad_json_ckpt" / "config.json").write_text('{"model_type": "qwen3_next",')
    shutil.copytree(ckpt, w / "unknown_family_ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (w / "unknown_family_ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "gpt9"}))
    shutil.copytree(ckpt, w / "truncated_ckpt")
    data = (w / "truncated_ckpt" / "model.safetensors").read_bytes()
    (w / "truncated_ckpt" / "model.safetensors").write_bytes(data[: len(data) // 2])
    shutil.copytree(ckpt, w / "garbage_ckpt")  # random bytes under a safetensors name
    (w / "garbage_ckpt" / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    shutil.copytree(ckpt, w / "nan_ckpt")
    _rewrite_tensor(w / "nan_ckpt", lambda t: t["model.norm.weight"].__setitem__(slice(0, 2), torch.tensor(
        [float("nan"), float("inf")])))
    shutil.copytree(ckpt, w / "nan_linked_ckpt")
    shutil.copy(w / "nan_ckpt" / "model.safetensors", w / "nan_linked_ckpt" / "model.safetensors")
    (w / "huge_layers").mkdir()
    (w / "huge_layers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000_000}))
    (w / "huge_vocab").mkdir()
    (w / "huge_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 1 << 40}))
    (w / "negative_layers").mkdir()
    (w / "negative_layers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -1}))

    # artifacts
    shutil.copytree(w / "art", w / "edited_art")  # a field edited by hand: the seal breaks
    doc = json.loads((w / "edited_art" / "manifest.json").read_text())
    (w / "edited_art" / "manifest.json").write_text(json.dumps({**doc, "family": "kimi_linear"}))
    shutil.copytree(w / "art", w / "vocab_art")  # resealed: only the cross-check sees it
    edit_manifest(w / "vocab_art", lambda m: {**m, "model": {**m["model"], "vocab_size": 1 << 20}})
    shutil.copytree(w / "art", w / "no_draft_art")
    edit_manifest(w / "no_draft_art", lambda m: {**m, "programs": {"main": m["programs"]["main"]}})
    shutil.copytree(w / "art", w / "routing_art")
    path = w / "routing_art" / "routing.json"
    path.write_text(path.read_text().replace("cpu_reference", "cpu_referencf", 1))
    shutil.copytree(w / "art", w / "weight_byte_art")
    path = w / "weight_byte_art" / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))

    # a tensor-parallel artifact (config.json alone, no weights) and its damaged copies
    assert main(["compile", str(w / "config_only"), "-o", str(w / "tp_art"), "--no-dumps", "--tp", "2",
                 "--no-weights", "-q"]) == 0
    shutil.copytree(w / "tp_art", w / "sharding_byte_art")  # sharding.json is hashed like every file
    path = w / "sharding_byte_art" / "sharding.json"
    path.write_text(path.read_text().replace('"tp": 2', '"tp":  2', 1))
    shutil.copytree(w / "tp_art", w / "tp_claim_art")  # resealed: only the cross-check with sharding.json sees it
    edit_manifest(w / "tp_claim_art", lambda m: {**m, "compile": {k: v for k, v in m["compile"].items() if k != "tp"}})

    # things that are not ours
    (w / "notes" / "2026").mkdir(parents=True)
    (w / "notes" / "todo.txt").write_text("mine")
    (w / "notes" / "2026" / "plan.md").write_text("also mine")
    (w / "empty_dir").mkdir()
    (w / "a_file").write_text("not a folder")
    return w


# (argv with {w} for the work folder, exit code, pattern the message must match)
CASES = [
    # hgc itself
    ([], 2, r"hgc: the following arguments are required: COMMAND"),
    (["frobnicate"], 2, r"hgc: argument COMMAND: invalid choice: 'frobnicate'"),
    (["compile", "{w}/ckpt", "--no-such-flag"], 2, r"unrecognized arguments: --no-such-flag"),
    # init-model
    (["init-model", "--family", "nope", "-o", "{w}/new"], 2, r"hgc init-model: argument --family: invalid choice: 'nope'"),
    (["init-model", "--family", FAMILY, "--size", "huge", "-o", "{w}/new"], 2, r"argument --size: invalid choice"),
    (["init-model", "--family", FAMILY, "--seed", "abc", "-o", "{w}/new"], 2, r"argument --seed: expected an integer"),
    (["init-model", "--family", FAMILY, "--seed", "-1", "-o", "{w}/new"], 2, r"argument --seed: must be in \[0, "),
    (["init-model", "--fam", FAMILY, "-o", "{w}/new"], 2, r"arguments are required: --family"),  # no prefixes
    (["init-model", "--family", FAMILY, "--shard-mb", "-1", "-o", "{w}/new"], 2, r"argument --shard-mb: must be in"),
    (["init-model", "--family", FAMILY], 2, r"the following arguments are required: -o/--output"),
    (["init-model", "--family", FAMILY, "-o", "{w}/ckpt"], 2, r"hgc init-model: .*ckpt: already exists; pass --force"),
    (["init-model", "--family", FAMILY, "-o", "{w}/notes", "--force"], 2,
     r"notes: refusing to replace it with --force: it is not a checkpoint folder .*todo.txt"),
    (["init-model", "--family", FAMILY, "-o", "{w}/a_file", "--force"], 2, r"a_file: exists and is not a folder"),
    # generate
    (["generate", "{w}/missing", "--prompt-ids", "1,2"], 2, r"hgc generate: .*missing: not a directory"),
    (["generate", "{w}/ckpt", "--prompt-ids", ""], 2, r"--prompt-ids"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,x"], 2, r"--prompt-ids: prompt 1 \('1,x'\) is not a comma-separated list of integers"),
    (["generate", "{w}/ckpt", "--prompt-ids", "-1"], 2, r"--prompt-ids"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,,2"], 2, r"--prompt-ids: prompt 1 \('1,,2'\) is not a comma-sep"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,2", "--max-new-token", "3"], 2,
     r"unrecognized arguments: --max-new-token 3"),
    (["generate", "{w}/ckpt", "--prompt-ids", "999999"], 2, r"token id 999999.*vocab"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "0"], 2,
     r"argument --max-new-tokens: must be at least 1"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "1000000000"], 2,
     r"--max-new-tokens 1000000000: .*max_position_embeddings"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "ten"], 2, r"argument --max-new-tokens"),
    (["generate", "{w}/ckpt", "--prompt-ids", "1,2", "--dtype", "int8"], 2, r"argument --dtype: invalid choice"),
    (["generate", "{w}/int32_ckpt", "--prompt-ids", "1,2"], 2, r"tensor 'model.norm.weight' is stored as I32"),
    (["generate", "{w}/missing_tensor_ckpt", "--prompt-ids", "1,2"], 2, r"model.norm.weight"),
    (["generate", "{w}/bad_json_ckpt", "--prompt-ids", "1,2"], 2, r"config.json"),
    (["generate", "{w}/unknown_family_ckpt", "--prompt-ids", "1,2"], 2, r"gpt9"),
    (["generate", "{w}/truncated_ckpt", "--prompt-ids", "1,2"], 2, r"model.safetensors"),
    (["generate", "{w}/garbage_ckpt", "--prompt-ids", "1,2"], 2, r"garbage_ckpt/model.safetensors: not a safetensors"),
    (["generate", "{w}/config_only", "--prompt-ids", "1,2"], 2, r"config_only.*safetensors"),
    # lint
    (["lint", "{w}/missing"], 2, r"hgc lint: .*missing: not a directory"),
    (["lint", "{w}/a_file"], 2, r"a_file"),
    (["lint", "{w}/ckpt", "--target", "tpu"], 2, r"argument --target: invalid choice: 'tpu'"),
    (["lint", "{w}/ckpt", "--dtype", "float8"], 2, r"argument --dtype: invalid choice"),
    (["lint", "{w}/ckpt", "--route", "nonsense"], 2, r"argument --route"),
    (["lint", "{w}/ckpt", "--route", "gdn_core=no_such_backend"], 2, r"no_such_backend"),
    (["lint", "{w}/negative_layers"], 2, r"num_hidden_layers"),
    (["lint", "{w}/unknown_family_ckpt"], 2, r"gpt9"),
    (["lint", "{w}/huge_layers"], 2, r"huge_layers/config.json: num_hidden_layers is 1000000000; hgc builds at most "
                                     r"1024 layers"),
    (["lint", "{w}/huge_vocab"], 2, r"config.json: vocab_size is 1099511627776, past the limit of 2147483647"),
    # compile
    (["compile", "{w}/ckpt"], 2, r"-o/--output is required"),
    (["compile", "{w}/ckpt", "-o", "{w}/art"], 2, r"art: already exists; pass --force"),
    (["compile", "{w}/ckpt", "-o", "{w}/notes", "--force"], 2, r"notes: refusing to replace it with --force: it is not "
                                                               r"an hgc artifact .*todo.txt"),
    (["compile", "{w}/ckpt", "-o", "{w}/ckpt", "--force"], 2, r"holds the checkpoint"),
    (["compile", "{w}/ckpt", "-o", "{w}/a_file/art"], 2, r"cannot write into"),
    (["compile", "{w}/config_only", "-o", "{w}/new"], 2, r"config_only.*safetensors"),
    (["compile", "{w}/int32_ckpt", "-o", "{w}/new"], 2, r"tensor 'model.norm.weight' is stored as I32"),
    (["compile", "{w}/garbage_ckpt", "-o", "{w}/new"], 2, r"garbage_ckpt/model.safetensors: not a safetensors file: "
                                                          r"its header length \(first 8 bytes\) says \d+ bytes"),
    (["compile", "{w}/huge_layers", "-o", "{w}/new", "--no-weights"], 2, r"num_hidden_layers is 1000000000"),
    (["compile", "{w}/nan_ckpt", "-o", "{w}/new"], 2, r"nan_ckpt/model.safetensors: tensor 'model.norm.weight' has 2 "
                                                      r"non-finite value\(s\) \(NaN or inf\) of 64; pass "
                                                      r"--allow-non-finite"),
    (["compile", "{w}/nan_linked_ckpt", "-o", "{w}/new", "--link-weights"], 2, r"tensor 'model.norm.weight' has 2 "
                                                                                r"non-finite value"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--decode-buckets", "4,2"], 2, r"argument --decode-buckets: expected increasing"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--decode-buckets", "a"], 2, r"argument --decode-buckets"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--extend-buckets", "0"], 2, r"argument --extend-buckets: expected increasing"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--bucket-costs", "{w}/no_costs.json"], 2, r"no_costs.json: missing"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--bucket-costs", "{w}/ckpt/config.json"], 2,
     r"config.json: field 'format' must be 'hgc-bucket-costs'"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--bucket-costs", "{w}/ckpt/config.json", "--extend-buckets", "16"], 2,
     r"--bucket-costs chooses the extend buckets from the measured costs: drop --extend-buckets"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--target", "gpu"], 2, r"argument --target: invalid choice: 'gpu'"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--tp", "0"], 2, r"argument --tp: must be at least 1 \(got 0\)"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--tp", "two"], 2, r"argument --tp: expected an integer, got 'two'"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--tp", "3"], 2,
     r"^hgc compile: tensor parallel 3: layer \d+ \(\w+\): \d+ [\w ]+ do not divide over 3 ranks; --tp must divide"),
    (["compile", "{w}/ckpt", "-o", "{w}/new", "--tp", "2", "--target", "cuda", "--inductor"], 2,
     r"--inductor: this machine has no CUDA device to build the bundle on"),
    (["lint", "{w}/config_only", "--tp", "-2"], 2, r"argument --tp: must be at least 1"),
    (["lint", "{w}/config_only", "--tp", "8"], 2, r"^hgc lint: tensor parallel 8: layer \d+ .* do not divide over 8 ranks"),
    (["lint", "{w}/config_only", "--memory-gb", "0"], 2, r"argument --memory-gb: must be in \(0"),
    # inspect / verify
    (["inspect", "{w}/missing"], 2, r"hgc inspect: .*missing: not an artifact folder"),
    (["inspect", "{w}/ckpt"], 2, r"ckpt/manifest.json: missing"),
    (["inspect", "{w}/edited_art"], 2, r"manifest.json: its content does not match its manifest_sha256"),
    (["inspect", "{w}/routing_art"], 2, r"routing.json"),
    (["inspect", "{w}/no_draft_art"], 2, r"field 'programs' is \['main'\], but the registry has 1 draft layer"),
    (["verify", "{w}/weight_byte_art"], 2, r"hgc verify: .*weights.safetensors"),
    (["verify", "{w}/missing"], 2, r"not an artifact folder"),
    (["verify", "{w}/sharding_byte_art"], 2, r"hgc verify: .*sharding.json: SHA-256 .* does not match manifest.json"),
    (["inspect", "{w}/tp_claim_art"], 2, r"manifest.json: compiled with --tp 1, but the artifact has a sharding.json "
                                         r"for 2 ranks"),
    (["build", "{w}/tp_art", "--device", "cuda"], 2, r"hgc build: hgc build .*tp_art --device cuda: this machine has "
                                                    r"no CUDA device"),
    # run
    (["run", "{w}/missing", "--prompt-ids", "1,2"], 2, r"hgc run: .*missing: not an artifact folder"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--max-new-tokens", "1000000000"], 2,
     r"--max-new-tokens 1000000000: .*max_position_embeddings"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--device", "cuda"], 2, r"argument --device: cuda: no GPU here"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--device", "foo"], 2, r"argument --device: 'foo' is not a device"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--max-tokens-per-step", "0"], 2,
     r"argument --max-tokens-per-step: must be at least 1"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--stop-ids", "x"], 2, r"argument --stop-ids: expected comma-separated"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--temperature", "-1"], 2, r"argument --temperature: must be in"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--top-p", "0"], 2, r"argument --top-p: must be in \(0, 1\]"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--top-k", "-3"], 2, r"argument --top-k: must be at least 0"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--snapshot-interval", "0"], 2, r"argument --snapshot-interval"),
    (["run", "{w}/art", "--prompt-ids", "999999"], 2, r"token id 999999.*vocab"),
    (["run", "{w}/art", "--prompt-ids", "1;;2"], 2, r"--prompt-ids"),
    (["run", "{w}/art", "--prompt-ids", "1,,2"], 2, r"--prompt-ids: prompt 1 \('1,,2'\) is not a comma-separated"),
    (["run", "{w}/art", "--prompt-ids", ",".join(["1"] * POSITIONS), "--max-new-tokens", "1"], 2,
     rf"--prompt-ids: prompt 1 has {POSITIONS} tokens; the model has {POSITIONS} positions .*at most {POSITIONS - 1}"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--seed", "1180591620717411303424"], 2,
     r"argument --seed: must be in \[0, 9223372036854775807\] \(got 1180591620717411303424\)"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--max-new-token", "3"], 2, r"unrecognized arguments: --max-new-token"),
    (["run", "{w}/vocab_art", "--prompt-ids", "1,2"], 2, r"model.vocab_size is 1048576, the main program's embedding"),
    (["run", "{w}/edited_art", "--prompt-ids", "1,2"], 2, r"manifest_sha256"),
    (["run", "{w}/weight_byte_art", "--prompt-ids", "1,2"], 2, r"weights.safetensors"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--tp", "0"], 2, r"argument --tp: must be at least 1 \(got 0\)"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--tp", "2"], 2,
     r"compiled for --tp 1, asked to run on 2 ranks: run it with one process"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--load-format", "random"], 2, r"argument --load-format: invalid choice"),
    (["run", "{w}/art", "--prompt-ids", "1,2", "--tp-timeout", "0"], 2, r"argument --tp-timeout: must be in \(0"),
    (["run", "{w}/tp_art", "--prompt-ids", "1,2"], 2, r"tp_art: compiled with --no-weights: .*--load-format dummy"),
    (["run", "{w}/tp_art", "--prompt-ids", "1,2", "--load-format", "dummy"], 2,
     r"compiled for --tp 2, asked to run as rank 0 of 1: run it with hgc run --tp 2"),
    (["run", "{w}/tp_art", "--prompt-ids", "1,2", "--tp", "4", "--load-format", "dummy"], 2,
     r"compiled for --tp 2, asked to run on 4 ranks: run it with --tp 2"),
    (["run", "{w}/tp_art", "--prompt-ids", "1,2", "--tp", "2", "--load-format", "dummy", "--speculative-tokens", "2"],
     2, r"^hgc run: --speculative-tokens 2 --tp 2: speculative decoding does not run on tensor-parallel ranks yet"),
    # serve (each is refused before the socket is bound)
    (["serve", "{w}/missing"], 2, r"hgc serve: .*missing: not an artifact folder"),
    (["serve", "{w}/art", "--port", "-1"], 2, r"argument --port: must be in \[0, 65535\]"),
    (["serve", "{w}/art", "--port", "http"], 2, r"argument --port: expected an integer"),
    (["serve", "{w}/art", "--port", "70000"], 2, r"argument --port: must be in \[0, 65535\] \(got 70000\)"),
    (["serve", "{w}/art", "--host", "no-such-host.invalid"], 2, r"argument --host: 'no-such-host.invalid' is not an "
                                                                 r"address to listen on"),
    (["serve", "{w}/art", "--port", "0", "--host", "192.0.2.1"], 2,
     r"--host 192.0.2.1 --port 0: cannot listen there"),  # an address of another machine (TEST-NET-1)
    (["serve", "{w}/art", "--slots", "0"], 2, r"argument --slots: must be at least 1"),
    (["serve", "{w}/art", "--max-model-len", "100000000"], 2, r"--max-model-len 100000000 exceeds the model's"),
    (["serve", "{w}/art", "--tokenizer", "{w}/empty_dir"], 2, r"--tokenizer .*empty_dir: no tokenizer.json"),
    (["serve", "{w}/art", "--device", "cuda:3"], 2, r"argument --device: cuda:3: no GPU here"),
    (["serve", "{w}/art", "--memory-budget-gb", "0.0001"], 2, r"memory|budget"),
    (["serve", "{w}/art", "--max-body-mb", "0"], 2, r"argument --max-body-mb: must be in \(0"),
    (["serve", "{w}/art", "--log-level", "loud"], 2, r"argument --log-level: invalid choice"),
    (["serve", "{w}/vocab_art"], 2, r"model.vocab_size"),
    (["serve", "{w}/tp_art", "--tp", "3", "--load-format", "dummy"], 2, r"compiled for --tp 2, asked to run on 3 ranks"),
    (["serve", "{w}/tp_art", "--tp", "2"], 2, r"compiled with --no-weights: .*--load-format dummy"),
    (["serve", "{w}/tp_art", "--tp", "2", "--load-format", "dummy", "--speculative-tokens", "1"], 2,
     r"^hgc serve: --speculative-tokens 1 --tp 2: speculative decoding does not run on tensor-parallel ranks yet"),
]


@pytest.fixture(autouse=True)
def never_listen(monkeypatch):
    """A serve case that got past its refusal would bind a socket and serve forever: fail it instead."""
    import hgc.serve_command

    def refuse(*args, **kwargs):
        raise AssertionError("serve was reached: the bad input was accepted")

    monkeypatch.setattr(hgc.serve_command, "serve", refuse)


def test_the_table_is_long_enough():
    assert len(CASES) >= 60
    assert {c[0][0] for c in CASES if c[0]} >= {"init-model", "generate", "lint", "compile", "inspect", "verify",
                                                  "build", "run", "serve"}


@pytest.mark.parametrize("argv, code, pattern", CASES, ids=[" ".join(c[0])[:60] or "(none)" for c in CASES])
def test_bad_input_is_one_short_message_and_changes_nothing(work, capsys, argv, code, pattern):
    argv = [a.replace("{w}", str(work)) for a in argv]
    if argv[:1] == ["serve"] and "--port" not in argv:
        argv += ["--port", "0"]  # a case refused after the socket is bound must not depend on port 8000 being free
    before = tree(work)
    assert main(argv) == code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    command = argv[0] if argv and not argv[0].startswith("frob") else None
    assert 1 <= len(lines) <= 3, err
    assert lines[0].startswith(f"hgc {command}: " if command else "hgc: "), err
    assert "Traceback" not in err + out and "Error:" not in lines[0].split(": ", 1)[0], err
    assert re.search(pattern, err), f"{pattern!r} not in:\n{err}"
    assert tree(work) == before  # nothing written, nothing left behind, nothing changed


def test_interrupt_is_one_line_exit_130_and_leaves_nothing(work, capsys, monkeypatch, tmp_path):
    """Ctrl-C while compile writes: the staging folder goes, one line, exit 130."""
    import compiler.artifact_writer as writer

    real = writer.write_artifact

    def interrupted(tmp, *args, **kwargs):
        real(tmp, *args, **kwargs)  # everything written into the staging folder, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_artifact", interrupted)
    out = tmp_path / "art"
    assert main(["compile", str(work / "ckpt"), "-o", str(out), "--no-dumps", "-q"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["hgc compile: interrupted (Ctrl-C); nothing half written was left behind"]
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(work, capsys):
    assert main(["inspect", str(work / "edited_art"), "--debug"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-2].startswith("hgc inspect: ")


def test_verify_full_finds_a_changed_byte_inside_linked_data(work, capsys):
    """Same size, same header: the load and a plain verify cannot tell; `verify --full` can."""
    assert main(["verify", str(work / "art")]) == 0
    assert "match manifest.json" in capsys.readouterr().out
    assert main(["verify", str(work / "linked_art"), "--full"]) == 0
    assert "data re-hashed" in capsys.readouterr().out
    path = work / "linked_ckpt" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:])
    try:
        assert main(["verify", str(work / "linked_art")]) == 0
        assert "--full re-hashes their data" in capsys.readouterr().out
        assert main(["verify", str(work / "linked_art"), "--full"]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert re.search(r"^hgc verify: .*model.safetensors: its data differs from the file the artifact linked", err)
        assert len(err.strip().splitlines()) == 2
    finally:
        path.write_bytes(data)


def test_exit_codes_are_the_readme_table():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    from hgc.errors import EXIT_CODES

    for code, meaning in EXIT_CODES.items():
        assert re.search(rf"\|\s*`?{code}`?\s*\|\s*{re.escape(meaning)}", readme), (code, meaning)


def test_run_and_generate_end_with_one_timing_line_unless_quiet(work, capsys):
    for argv, detail in ((["generate", str(work / "ckpt")], "eager model, cpu reference"),
                         (["run", str(work / "art")], "prefill 5 token(s)")):
        assert main([*argv, "--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "3"]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines() == [line for line in out.splitlines() if " -> " in line] and len(out.splitlines()) == 2
        # run says its memory plan first (runtime/assembly.py build_engine); the timing line is the last
        timing = [line for line in err.splitlines() if "new token(s) in" in line]
        assert len(timing) == 1 and err.splitlines()[-1] == timing[0] and timing[0].startswith(f"hgc {argv[0]}: ")
        assert re.search(r"2 prompt\(s\), 6 new token\(s\) in [\d.]+ s, [\d.]+ tok/s", timing[0])
        assert detail in timing[0], timing
    assert main(["run", str(work / "art"), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_port_in_use_is_refused_before_loading(work, capsys, monkeypatch):
    import socket

    import runtime.assembly

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(runtime.assembly, "load_served_model", refuse)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(work / "art"), "--port", str(port)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"hgc serve: --host 127.0.0.1 --port {port}: cannot listen there: "), err
    assert len(err.strip().splitlines()) == 2


def test_a_closed_pipe_ends_quietly(work):
    """`hgc inspect A | head -1`: the reader leaves early; no "Broken pipe", exit 0."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "hgc", "inspect", str(work / "art")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command writes
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0 and err == "", err


def test_weights_the_model_does_not_read_are_one_warning_line_and_a_lint(work, capsys, tmp_path):
    """A checkpoint with a tensor no program reads and no tokenizer: the compile succeeds, says
    each in one warning line, and lists both in lints.json. NaN weights compile with the flag."""
    ckpt = shutil.copytree(work / "nan_ckpt", tmp_path / "ckpt")
    _rewrite_tensor(ckpt, lambda t: t.update({"model.layers.99.stray.weight": torch.zeros(3)}))
    (ckpt / "tokenizer.json").unlink()
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "art"), "--no-dumps", "-q"]) == EXIT_BAD_INPUT
    assert "non-finite" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "art"), "--no-dumps", "-q", "--allow-non-finite"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hgc compile: warning: ")]
    assert len(warnings) == 2, warnings
    assert re.search(r"1 checkpoint tensor\(s\) no program reads: model.layers.99.stray.weight", warnings[0] + warnings[1])
    assert re.search(r"has no tokenizer.json: the artifact serves token ids only", warnings[0] + warnings[1])
    lints = json.loads((tmp_path / "art" / "lints.json").read_text())
    assert {f["rule"] for f in lints["findings"]} >= {"unused_tensors", "no_tokenizer"}


@pytest.mark.parametrize("argv, pattern", [
    (["serve", "{w}/missing"], r"missing: not an artifact folder"),
    (["serve", "{w}/art", "--tokenizer", "{w}/empty_dir"], r"no tokenizer.json"),
    (["serve", "{w}/art", "--max-model-len", "100000000"], r"exceeds the model's"),
], ids=["no artifact", "no tokenizer", "past the positions"])
def test_a_split_serve_refuses_what_the_documents_decide_before_its_engine_core_starts(work, capsys, monkeypatch,
                                                                                     argv, pattern):
    """The refusals `check_served_inputs` makes come from the server process itself: no engine core is
    launched for them (a core's start and imports took seconds before it said the same)."""
    import re

    from runtime.core.client import EngineCoreClient

    def no_core(*args, **kwargs):
        raise AssertionError("the engine core was launched for a refusal the documents decide")

    monkeypatch.setattr(EngineCoreClient, "launch", no_core)
    assert main([a.replace("{w}", str(work)) for a in argv] + ["--port", "0"]) == EXIT_BAD_INPUT
    assert re.search(pattern, capsys.readouterr().err)
