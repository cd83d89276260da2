"""Tensor parallel on the CPU: real torch.distributed (gloo), real rank processes, real checkpoints.

- Two ranks of each family give exactly the float32 tokens of one process: the eager model's
  (`hgc generate`), which a one-process compile of every family gives exactly
  (tests/compiler/test_compiler_families.py), so no one-process artifact is compiled here. The
  checkpoints are chosen to reach the cases sharding gets wrong: Qwen3-Next with one KV head
  (held whole by both ranks) and two GDN key heads a rank (each rank rearranges the rows it reads
  of the projections the checkpoint stores per key head), Qwen3.5 with its KV heads split, Kimi-Linear's MLA and KDA, Bailing
  with biases on its fused q|k|v and row-parallel projections (each added once, after the sum).
  Three run `hgc run --tp 2` (one under torchrun); Qwen3-Next is served (below).
- Each rank reads its part of every tensor: the parts, put back together by their specs, are the
  checkpoint's whole tensors; with --load-format dummy, the whole random tensors one process makes.
- A sharding that does not divide is a compile error naming the layer and the numbers; `hgc lint
  --tp N` runs on a folder with only config.json; `hgc inspect` and the dumps show the collectives.
- `hgc serve --tp 2` of a config-only compile (--no-weights) with dummy weights answers as one
  process does (the eager model on a checkpoint of the same dummy tensors), a repeated prompt
  reuses its prefix (the pool changes rank 0 journals reach rank 1), it prints the memory per
  rank, and when rank 1 is killed mid-request the server exits with an error naming it within a
  bound. One launch of two ranks per family, in all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hgc import main
from hgc.errors import EXIT_BAD_INPUT
from testkit.helpers import ROOT, ServerProcess, tiny_checkpoint

pytestmark = pytest.mark.slow  # 4 compiles and 4 launches of 2 ranks

PROMPTS = "1,2,3,4,5,6,7,8;9,10,11"
NEW_TOKENS = 6
# What each family's tiny checkpoint changes, and why (module docstring). `hgc run` runs no draft
# program, so the checkpoints drop their MTP layers (which halves compile and start-up); the lint
# test shards a draft program.
FAMILIES = {
    "qwen3_next": {"num_key_value_heads": 1, "num_nextn_predict_layers": 0, "linear_num_key_heads": 4,
                   "linear_num_value_heads": 8},
    "qwen3_5": {"mtp_num_hidden_layers": 0},
    "kimi_linear": {},
    "bailing_linear": {"use_bias": True, "use_qkv_bias": True, "num_nextn_predict_layers": 0},
}
SERVED = "qwen3_next"  # served (its tokens checked there); the other families go through `hgc run --tp 2`
DEATH_BOUND_S = 15.0  # from a rank's death to the server's exit (the watchdog looks every 0.2 s)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _compile(ckpt: Path, out: Path, *flags: str, dumps: bool = False) -> Path:
    assert main(["compile", str(ckpt), "-o", str(out), *([] if dumps else ["--no-dumps"]), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> {"ckpt", "tp2"}: a tiny checkpoint (FAMILIES' overrides) compiled for two ranks;
    Qwen3-Next's from its config.json alone (--no-weights: it is served with dummy weights)."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for family, overrides in FAMILIES.items():
        ckpt = tiny_checkpoint(family, root / f"{family}-ckpt", seed=3, **overrides)
        if family == SERVED:
            (root / "config-only").mkdir()
            shutil.copy(ckpt / "config.json", root / "config-only" / "config.json")
            tp2 = _compile(root / "config-only", root / f"{family}-tp2", "--tp", "2", "--no-weights")
        else:
            tp2 = _compile(ckpt, root / f"{family}-tp2", "--tp", "2", dumps=family == "kimi_linear")
        out[family] = {"ckpt": ckpt, "tp2": tp2}
    return out


def _one_process(capsys, command: str, path: Path, *flags: str) -> dict:
    """`hgc generate` (a checkpoint) or `hgc run` (an artifact) in this process, its --json output."""
    argv = [command, str(path), "--prompt-ids", PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _launch(argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != SERVED])
def test_tp2_gives_the_float32_tokens_of_one_process(arts, family, capsys):
    one = _one_process(capsys, "generate", arts[family]["ckpt"])
    run = ["-m", "hgc", "run", str(arts[family]["tp2"]), "--tp", "2", "--prompt-ids", PROMPTS,
           "--max-new-tokens", str(NEW_TOKENS), "--json"]
    if family == "qwen3_5":  # the same ranks started by torchrun instead of hgc's launcher
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *run]
    else:
        argv = [sys.executable, *run]
    proc = _launch(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])  # rank 0 alone prints
    assert two["outputs"] == one["outputs"]
    # every layer ran its own backend and the collectives
    assert all(set(b) == {"cpu_reference", "gloo"} for b in two["executed_backends"].values()), two
    assert "memory per rank of tensor parallel 2" in proc.stderr


def _whole(parts: list[torch.Tensor], spec) -> torch.Tensor:
    """Put rank parts back together along spec.dim: each rank holds, per segment, one chunk."""
    if spec.replicated:
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    tp, pieces = len(parts), []
    offsets = [0] * tp
    for length, nparts in spec.segments:
        chunk = length // nparts
        for index in range(nparts):
            rank = index * tp // nparts  # the first rank holding this chunk (others hold copies)
            pieces.append(parts[rank].narrow(spec.dim, offsets[rank], chunk))
        offsets = [o + chunk for o in offsets]
    return torch.cat(pieces, spec.dim)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_rank_parts_put_together_are_the_whole_tensors(arts, load_format):
    """Every checkpoint tensor of the Bailing artifact (fused q|k|v with biases, computed decays),
    read as rank 0 and rank 1, is the whole tensor one process reads (the checkpoint's, or the
    dummy one) once its parts are joined."""
    from safetensors.torch import load_file

    from compiler.splitops.artifact import WEIGHT_MAP, load_json, parse_weights_doc
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.weights import WeightFiles, dummy_tensor, whole_shapes

    docs = read_artifact(arts["bailing_linear"]["tp2"])
    sources, _ = parse_weights_doc(load_json(docs.path / WEIGHT_MAP), WEIGHT_MAP)
    shapes = whole_shapes(sources, docs.sharding)
    ranks = [WeightFiles(docs, "cpu", rank=r, dummy=load_format == "dummy", whole_shapes=shapes) for r in range(2)]
    checkpoint = {}
    for path in arts["bailing_linear"]["ckpt"].glob("*.safetensors"):
        checkpoint.update(load_file(path))
    cut = 0
    for name, spec in docs.sharding.tensors.items():
        if name.endswith(".log_decay"):  # computed from config.json; the checkpoint has no such tensor
            whole = _whole([r.get(name) for r in ranks], spec)
            assert whole.shape[0] == 2 * ranks[0].get(name).shape[0]
            continue
        one = dummy_tensor(name, shapes[name]) if load_format == "dummy" else checkpoint[name]
        assert torch.equal(_whole([r.get(name) for r in ranks], spec), one), name
        cut += not spec.replicated
    fused = docs.sharding.tensors["model.layers.0.attention.query_key_value.bias"]
    assert len(fused.segments) == 3 and cut > 40


def test_a_sharding_that_does_not_divide_is_a_compile_error_and_lint_tp_needs_only_config_json(arts, tmp_path, capsys):
    folder = tmp_path / "config-only"
    folder.mkdir()
    config = json.loads((arts["qwen3_next"]["ckpt"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))  # with its draft
    assert main(["lint", str(folder), "--tp", "3"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[0]  # then a hint line
    assert err == ("hgc lint: tensor parallel 3: layer 3 (full_gqa): 4 attention heads do not divide over 3 ranks; "
                   "--tp must divide 4 (1, 2, 4)"), err
    assert main(["compile", str(arts["kimi_linear"]["ckpt"]), "-o", str(tmp_path / "x"), "--tp", "4"]) == EXIT_BAD_INPUT
    assert "(full_mla): 2 attention heads do not divide over 4 ranks; --tp must divide 2 (1, 2)" in capsys.readouterr().err
    # 64 KiB of GPU memory: no error in the graphs, but one rank does not fit, and says by how much
    assert main(["lint", str(folder), "--tp", "2", "--json", "--memory-gb", str(64 / (1 << 20))]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["counts"]["error"] == 0 and sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert doc["memory"]["fits"] is False and doc["memory"]["missing_bytes"] > 0
    assert re.search(r"memory plan, per rank of tensor parallel 2: .* bytes are missing per rank", err), err
    # every layer sums its attention output and its MLP; lm_head's logits are gathered after the
    # last layer of each program (the draft has the main model's lm_head)
    for program in ("main", "draft"):
        rows = [r for r in doc["layers"] if r["program"] == program]
        assert rows and all(r["ops"].count("all_reduce") == 2 for r in rows), rows
        assert rows[-1]["ops"].endswith("all_gather") and "gloo" in rows[-1]["backend"]
    assert doc["memory"]["tp"] == 2 and 0 < doc["memory"]["weight_bytes_per_rank"] < doc["memory"]["weight_bytes"]


def test_inspect_and_the_dumps_show_the_collectives_and_the_one_process_run_is_refused(arts, capsys):
    art = arts["kimi_linear"]["tp2"]  # compiled with its dumps
    capsys.readouterr()
    dump = (art / "dumps" / "01_sharding.txt").read_text()
    assert "= hgc.all_reduce(" in dump and "= hgc.all_gather(" in dump and "# shard: dim 1 / 2" in dump
    assert main(["inspect", str(art), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    collectives = doc["sharding"]["collectives"]["main"]
    assert doc["sharding"]["tp"] == 2 and doc["sharding"]["moe"] == "tensor-parallel experts"
    assert [c["op"] for c in collectives].count("all_gather") == 1 and len(collectives) == 2 * 4 + 1
    assert main(["inspect", str(art)]) == 0
    assert "tensor parallel 2: MoE as tensor-parallel experts" in capsys.readouterr().out
    assert main(["run", str(art), "--prompt-ids", "1,2"]) == EXIT_BAD_INPUT
    assert "compiled for --tp 2, asked to run as rank 0 of 1: run it with hgc run --tp 2" in capsys.readouterr().err


def test_serve_tp2_with_dummy_weights_answers_like_one_process_and_a_dead_rank_stops_it(arts, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from runtime.artifact.weights import dummy_tensor

    httpx = pytest.importorskip("httpx")
    # one process with the same random weights: the eager model on a checkpoint of the dummy tensors
    # (a function of name and whole shape, which is what makes every rank count cut the same values)
    dummy = shutil.copytree(arts[SERVED]["ckpt"], tmp_path / "dummy-ckpt")
    for path in dummy.glob("*.safetensors"):
        save_file({name: dummy_tensor(name, tuple(t.shape)) for name, t in load_file(path).items()}, path,
                  metadata={"format": "pt"})
    one = _one_process(capsys, "generate", dummy)
    prompt = list(range(3, 40))
    server = ServerProcess([str(arts[SERVED]["tp2"]), "--served-model-name", "tiny", "--tp", "2",
                            "--load-format", "dummy", "--max-model-len", "512",
                            "--slots", "4", "--memory-budget-gb", "0.05", "--shutdown-timeout", "2"])
    try:
        server.wait_ready(120)
        pids = [int(p) for p in re.search(r"launched 2 ranks \(pids (\d+), (\d+)", server.log()).groups()]
        assert "memory plan" in server.log() and "per rank of tensor parallel 2" in server.log()
        first = [int(t) for t in PROMPTS.split(";")[0].split(",")]
        got = httpx.post(f"{server.url}/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": first, "max_tokens": NEW_TOKENS, "temperature": 0}).json()
        assert got.get("choices", [{}])[0].get("token_ids") == one["outputs"][0]["output_ids"], got
        answers = [httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).json() for _ in range(2)]
        assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # restored on rank 1 as well
        received = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0,
                                "stream": True}) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # the request is being decoded
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            try:  # rank 0's failed step may still answer with an error event, or its exit cuts the stream
                received += [line for line in lines if line.startswith("data: {")]
            except httpx.HTTPError:
                pass
        server.proc.wait(DEATH_BOUND_S)
        took = time.monotonic() - killed
    finally:
        server.kill()
    log = server.log()
    assert server.proc.returncode == 1, log[-2000:]
    assert "rank 1 stopped: its step channel closed" in log, log[-2000:]
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", log), log[-2000:]
    assert took < DEATH_BOUND_S, took
    for pid in pids:  # no rank left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not any('"finish_reason":"length"' in line.replace(" ", "") for line in received), received[-2:]
