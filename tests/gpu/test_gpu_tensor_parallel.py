"""Tensor parallel on two GPUs (symmetric memory and NCCL, collectives inside the captured CUDA graphs).

- `hgc run --tp 2` of a tiny Kimi-Linear compiled for cuda in float32 (MLA on the Triton kernel,
  KDA and the MoE on theirs, the all-reduces on symmetric memory, the gather on NCCL) gives the
  tokens of one GPU, with its decode steps replayed from whole-step graphs on both ranks.
- The same artifact with compiled pieces (`hgc build --device cuda`, which launches both ranks, each
  compiling the glue for its own GPU): the same tokens, each rank's pieces loaded, nothing built at
  start-up.
- `hgc serve --tp 2`: rank 1 killed while rank 0 replays decode graphs (a collective in a graph
  waits for its peer without a timeout) ends the server within a bound, naming rank 1.

Marked gpu (CI deselects it); needs two GPUs. The benchmark of the full-size releases is
benchmarks/serving/tp_bench.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from hgc import main
from testkit.helpers import ROOT, ServerProcess, tiny_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PROMPTS = "1,2,3,4,5,6,7,8;9,10,11"


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-tp")
    ckpt = tiny_checkpoint("kimi_linear", root / "ckpt", seed=3)
    out = {}
    for tp in (1, 2):
        out[tp] = root / f"tp{tp}"
        assert main(["compile", str(ckpt), "-o", str(out[tp]), "--no-dumps", "--target", "cuda", "--no-inductor",
                     "--tp", str(tp)]) == 0
    return out


def test_tp2_on_two_gpus_gives_the_float32_tokens_of_one_gpu(arts, capsys):
    assert main(["run", str(arts[1]), "--prompt-ids", PROMPTS, "--max-new-tokens", "8", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "hgc", "run", str(arts[2]), "--tp", "2", "--prompt-ids",
                           PROMPTS, "--max-new-tokens", "8", "--json"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two["outputs"] == one["outputs"]
    # every layer's all-reduces ran on a collective backend: symmetric memory's one-shot (routing's
    # choice for them on cuda) where they fit, NCCL's gather after the last layer
    ran = two["executed_backends"].values()
    assert all({"symm_mem", "nccl"} & set(b) for b in ran) and any("symm_mem" in b for b in ran), ran
    assert two["steps"]["graph_replays"] > 0, two["steps"]  # decode ran from the captured graphs


def test_tp2_compiled_pieces_on_two_gpus_give_the_same_tokens(arts, tmp_path, capsys):
    assert main(["run", str(arts[1]), "--prompt-ids", PROMPTS, "--max-new-tokens", "8", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    art = tmp_path / "tp2-compiled"
    subprocess.run(["cp", "-r", str(arts[2]), str(art)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HGC_HOME=str(tmp_path / "home"))
    built = subprocess.run([sys.executable, "-m", "hgc", "build", str(art), "--device", "cuda"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-4000:]
    proc = subprocess.run([sys.executable, "-m", "hgc", "run", str(art), "--tp", "2", "--prompt-ids",
                           PROMPTS, "--max-new-tokens", "8", "--json"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two["outputs"] == one["outputs"]
    assert two["compiled"]["pieces"] >= 1 and two["compiled"]["kernel_builds"] == 0, two["compiled"]
    assert two["steps"]["graph_replays"] > 0, two["steps"]


def test_a_rank_killed_during_graph_replays_stops_the_server(arts):
    httpx = pytest.importorskip("httpx")
    server = ServerProcess([str(arts[2]), "--served-model-name", "tiny", "--tp", "2", "--max-model-len", "2048",
                            "--slots", "4"])
    try:
        server.wait_ready(600)
        pids = [int(p) for p in re.search(r"launched 2 ranks \(pids (\d+), (\d+)", server.log()).groups()]
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "temperature": 0,
                                "stream": True}) as stream:
            lines = stream.iter_lines()
            for _ in range(20):  # well into decode: every step a graph replay on both ranks
                next(lines)
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        server.proc.wait(30)
        took = time.monotonic() - killed
    finally:
        server.kill()
    log = server.log()
    assert server.proc.returncode == 1 and "rank 1 stopped: its step channel closed" in log, log[-3000:]
    assert took < 15, took
