"""Shared test helpers: run a family model eagerly on the CPU reference backend; run `hgc serve`;
one compiled tiny artifact per family for the whole test session (`shared_artifact`), or per module
for a module that compiles with its own routes (`artifacts_by_family`); a bad input's one-line error
(`assert_one_line_error`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools, run_step
from testkit.traces import shared_traces


class EagerRunner:
    """One model bound to fresh pools; `step(...)` runs one step and returns its logits rows."""

    def __init__(self, model, max_tokens: int = 512, num_seqs: int = 8, page_size: int = 16):
        self.model = model
        self.kv_pool, self.state_pool = make_pools(model.layer_registry, max_tokens, num_seqs, page_size)
        self.ops = BoundOps(CPUReferenceBackend(self.kv_pool, self.state_pool))
        model.set_ops(self.ops)

    def new_seq(self) -> SeqState:
        return SeqState(self.state_pool.alloc())

    def step(self, items, all_logits: bool = False) -> torch.Tensor:
        """items: [(SeqState, token ids)]. Returns logits of every row if all_logits, else last rows."""
        if all_logits:
            forward = lambda ids, pos, _: self.model(ids, pos, torch.arange(ids.shape[0]))
        else:
            forward = self.model
        return run_step(forward, self.ops, items, self.kv_pool)


def eager_logits(model, prompt: list[int], decode_ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position, then of each forced decode token: [len(prompt)+len(decode_ids), V]."""
    runner = EagerRunner(model, max_tokens=len(prompt) + len(decode_ids) + 1, num_seqs=1)
    seq = runner.new_seq()
    rows = [runner.step([(seq, list(prompt))], all_logits=True)]
    for tok in decode_ids:
        rows.append(runner.step([(seq, [tok])]))
    return torch.cat(rows)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max |b|: the tolerance measure of the family equivalence tests."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def tiny_checkpoint(family_name: str, out, seed: int = 0, **config_overrides):
    """`hgc init-model --size tiny` of a family, with config.json fields overridden (e.g. head_dim=64:
    FlashInfer's prefill kernels take head dims 64, 128 and 256, tiny's GQA layers have 32)."""
    from models.checkpoint import write_checkpoint
    from models.families import get_family
    from models.loader import config_dtype

    family = get_family(family_name)
    config = {**family.make_config("tiny"), **config_overrides}
    text = family.text_config(config)
    model = family.build(text)
    family.init_weights(model, seed)
    write_checkpoint(out, config, model.to(config_dtype(text)).checkpoint_tensors())
    return out


def shared_artifact(tmp_path_factory, family_name: str) -> tuple[Path, Path]:
    """(checkpoint, artifact) of `hgc init-model --family F --size tiny --seed 0` compiled for the
    CPU without dumps, built once per test session and shared by every module that asks, under
    pytest-xdist by every worker too (a file lock: the first compiles, the others wait for it).
    Their users only read them. The names are benchmarks/bench_common.compiled_artifact's, so a
    benchmark's dry run given the folder as --work finds the artifact there."""
    from filelock import FileLock

    from hgc import main

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-artifacts"
    root.mkdir(exist_ok=True)
    ckpt, art = root / f"{family_name}-tiny", root / f"{family_name}-tiny-art"
    with FileLock(str(root / f"{family_name}.lock")):
        if not (art / "manifest.json").is_file():  # the writer renames a finished artifact into place
            assert main(["init-model", "--family", family_name, "--size", "tiny", "--seed", "0", "-o", str(ckpt),
                         "--force", "-q"]) == 0
            with shared_traces():  # its trace serves this process's other compiles of the config
                assert main(["compile", str(ckpt), "-o", str(art), "--no-dumps", "--force", "-q"]) == 0
    return ckpt, art
def artifacts_by_family(root: Path, compile_one, overrides: dict | None = None):
    """get(family) -> the artifact of its tiny checkpoint (`hgc init-model`, seed 0) compiled by
    compile_one(family, checkpoint_dir, out_dir), made and loaded once per family (for a
    module-scoped fixture: only the families a module's tests ask for are compiled). overrides:
    family -> config.json fields of its checkpoint (`tiny_checkpoint`'s), e.g. fewer layers."""
    from hgc import main
    from runtime.artifact.loader import load_artifact

    made = {}

    def get(family: str):
        if family not in made:
            ckpt, out = root / f"{family}-c", root / f"{family}-a"
            if overrides and family in overrides:
                tiny_checkpoint(family, ckpt, seed=0, **overrides[family])
            else:
                assert main(["init-model", "--family", family, "--size", "tiny", "--seed", "0", "-o", str(ckpt)]) == 0
            with shared_traces():
                compile_one(family, ckpt, out)
            made[family] = load_artifact(out)
        return made[family]

    return get


def rehash(art) -> None:
    """Recompute manifest.json's SHA-256 of every listed file, and its seal: an edit then passes the
    hash checks, so only the check under test can catch it."""
    edit_manifest(art, lambda m: {**m, "files": {name: sha256_file(art / name) for name in m["files"]
                                                 if (art / name).exists()}})


def edit_manifest(art, edit) -> None:
    """Rewrite manifest.json with `edit(manifest) -> manifest` and seal it again, as a compiler would
    have written it: only the cross-checks can then catch the edit."""
    import json

    from compiler.splitops.artifact import MANIFEST, dump_json, seal_manifest

    manifest = json.loads((art / MANIFEST).read_text())
    (art / MANIFEST).write_bytes(dump_json(seal_manifest(edit(manifest))))


def sha256_file(path) -> str:
    from compiler.splitops.artifact import sha256_file as sha
    return sha(path)


def edit_routing(art, edit) -> None:
    """Rewrite every entry of routing.json with `edit(entry) -> entry`, then re-hash the artifact."""
    import json

    from compiler.splitops.artifact import ROUTING, dump_json

    doc = json.loads((art / ROUTING).read_text())
    doc["programs"] = {p: [edit(dict(e)) for e in entries] for p, entries in doc["programs"].items()}
    (art / ROUTING).write_bytes(dump_json(doc))
    rehash(art)


ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`python -m hgc serve ARTIFACT --port 0 ...` in a subprocess; `wait_ready()` gives its URL."""

    def __init__(self, args: list[str], first_on_path: str | None = None):
        """`first_on_path`: a folder searched before every other for imports (e.g. one whose module
        hides an installed optional extra)."""
        path = ([first_on_path] if first_on_path else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        threads = [] if "--threads" in args else ["--threads", "1"]
        self.proc = subprocess.Popen([sys.executable, "-m", "hgc", "serve", *args, "--host", "127.0.0.1",
                                      "--port", "0", *threads, "--log-level", "warning"],
                                     cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = None

        def drain():  # keep the pipe empty, and catch the "listening" line
            for line in self.proc.stderr:
                self.lines.append(line)
                if "listening on http://" in line and self.url is None:
                    self.url = line.split("listening on ")[1].split()[0]
                    self._listening.set()
            self._listening.set()

        threading.Thread(target=drain, daemon=True).start()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        if not self._listening.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        return self

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def assert_one_line_error(call, names: str) -> None:
    """call() raises a ValueError with a one-line message that contains `names` (what was at fault)."""
    with pytest.raises(ValueError) as err:
        call()
    assert names in str(err.value) and "\n" not in str(err.value), str(err.value)
