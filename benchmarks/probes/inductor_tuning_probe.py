"""Where a compiled piece's launch-configuration choices live, and whether a second process finds them.

    python3 benchmarks/probes/inductor_tuning_probe.py --out $OUT          # on the GPU machine

Inductor's Triton kernels with several candidate configurations time them at their first launch and
keep the winner in a `.best_config` file beside the kernel's source. `hgc build` copies what its
start-up wrote into the bundle, yet a start-up from that bundle tuned 35 kernels again. This probe
reproduces the two processes on one small glue graph (RMSNorm, a residual add, a softmax: reductions
and pointwise kernels, the token count dynamic), the way the bundle does them:

1. build: Inductor's cache at folder B; compile with standalone_compile, save the piece, load it
   back, run it at two token counts (it tunes), list the .best_config files B gained;
2. copy B (less Inductor's indexes) and its Triton cache to folder C, as a bundle's kernels;
3. run: a fresh process with Inductor's cache at C loads the piece and runs it; every autotune-cache
   lookup is logged (kernel file, candidates, hit or miss), and the files C and B gain or change
   are listed. Once with B still in place, once with B moved away (another machine).

It prints one JSON document (and writes it under --out). No number of it is a speed claim.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEXES = ("fxgraph", "aotautograd", "locks")


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


def _changes(before: dict, after: dict) -> dict:
    return {"new": sorted(f for f in after if f not in before),
            "changed": sorted(f for f in after if f in before and before[f] != after[f])}


def _patches() -> dict:
    """Inductor settings of this probe's variant (PROBE_PATCHES, JSON), on top of the bundle's."""
    from compiler.splitops.bundle import INDUCTOR_CONFIG
    return {**INDUCTOR_CONFIG["cuda"], **json.loads(os.environ.get("PROBE_PATCHES", "{}"))}


def _spy() -> list[dict]:
    """Log every autotune-cache lookup (cached_autotune and the static launcher's recheck both call it)."""
    from torch._inductor.runtime import triton_heuristics as th

    log: list[dict] = []
    original = th.check_autotune_cache

    def check(configs, filename, inductor_meta):
        out = original(configs, filename, inductor_meta)
        # the probe's folders: .../tuning-probe-XXXXXXXX/<B, C or D>/...
        where = filename.split("tuning-probe-")[-1].split("/")[1] if filename and "tuning-probe-" in filename else "other"
        log.append({"folder": where, "file": filename, "candidates": len(configs),
                    "state": out[2].get("autotune_cache_state")})
        return out

    th.check_autotune_cache = check
    return log


def _glue():
    import torch

    class Glue(torch.nn.Module):
        def forward(self, x, residual, weight):
            h = x + residual
            normed = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * weight
            # a transpose (2-d tiled pointwise) and a sum over tokens (outer reduction): several candidates each
            return normed, torch.softmax(normed.float(), dim=-1).sum(-1), x.t().contiguous(), h.float().sum(0)

    return Glue()


def _inputs(tokens: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, torch.randn_like(x), torch.ones(1024, device="cuda", dtype=torch.bfloat16)


def child_build(piece: Path) -> dict:
    import torch
    from torch._inductor import CompiledArtifact, config, standalone_compile

    from compiler.inductor_pieces import fake_inputs
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    log = _spy()
    tokens = torch.export.Dim("T", min=2, max=4096)
    ep = torch.export.export(_glue(), _inputs(8), dynamic_shapes=({0: tokens}, {0: tokens}, None))
    gm = ep.graph_module
    with torch.no_grad():
        compiled = standalone_compile(gm, fake_inputs(gm, torch.device("cuda", 0)), dynamic_shapes="from_graph",
                                      options={"config_patches": _patches()})
    compiled.save(path=str(piece), format="binary")
    after_compile = _files(cache)
    with config.patch(_patches()):
        loaded = CompiledArtifact.load(path=str(piece), format="binary")
    for t in (5, 300):
        loaded(*_inputs(t))
    torch.cuda.synchronize()
    return {"lookups": log, "after_compile": _changes({}, after_compile)["new"],
            "by_first_runs": _changes(after_compile, _files(cache))}


def child_run(piece: Path, build_cache: Path) -> dict:
    import torch
    from torch._inductor import CompiledArtifact

    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    log = _spy()
    from torch._inductor import config

    before, before_build = _files(cache), _files(build_cache)
    with config.patch(_patches()):
        loaded = CompiledArtifact.load(path=str(piece), format="binary")
    after_load = _files(cache)
    for t in (5, 300):
        loaded(*_inputs(t))
    torch.cuda.synchronize()
    return {"lookups": log, "by_load": _changes(before, after_load), "by_runs": _changes(after_load, _files(cache)),
            "build_folder": _changes(before_build, _files(build_cache))}


def _child(step: str, patches: dict, cache: Path, triton: Path, *args: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(triton),
               PROBE_PATCHES=json.dumps(patches),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--child", step, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _copy_bundle_like(src: Path, dest: Path) -> None:
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_file() and rel.parts[0] not in INDEXES and not p.name.endswith(".lock"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest / rel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "build":
        print(json.dumps(child_build(Path(args.rest[0]))))
        return 0
    if args.child == "run":
        print(json.dumps(child_run(Path(args.rest[0]), Path(args.rest[1]))))
        return 0
    import torch
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "variants": {}}
    for variant, patches in (("default", {}), ("no_static_launcher", {"use_static_cuda_launcher": False})):
        work = Path(tempfile.mkdtemp(prefix="tuning-probe-"))
        piece = work / "piece.bin"
        out = report["variants"][variant] = {"patches": patches}
        out["build"] = _child("build", patches, work / "B", work / "Bt", str(piece))
        out["build"]["best_configs"] = sorted(str(p.relative_to(work / "B")) for p in (work / "B").rglob("*.best_config"))
        for name, keep_build in (("run_with_build_folder", True), ("run_without_build_folder", False)):
            copy = work / ("C" if keep_build else "D")
            _copy_bundle_like(work / "B", copy / "inductor")
            _copy_bundle_like(work / "Bt", copy / "triton")
            if not keep_build:
                (work / "B").rename(work / "B-away")
            out[name] = _child("run", patches, copy / "inductor", copy / "triton", str(piece), str(work / "B"))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "inductor_tuning_probe.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
