"""Why a start-up from a built bundle compiles Triton kernels the bundle already holds under another key.

    python3 benchmarks/probes/bundle_keys_probe.py --out $OUT          # on the GPU machine (wheels installed)

Triton files a compiled kernel under a hash of its source, its specialization (which integer
arguments are 1 or divisible by 16, which pointers are 16-byte aligned), its constexpr values, the
compile options and some environment variables. A run that finds the same kernel under another
hash compiles it again. This probe builds the tiny qwen3_next artifact as tests/gpu/test_gpu_inductor.py
does, runs it once with builds allowed (its private copy of the bundle kept), and for every Triton
kernel the run compiled, compares the run's files with the bundle's file of the same name: the
metadata fields that differ, and the kernel's signature line in its TTIR (the specialization).
One JSON document under --out; nothing in it is a speed claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# `hgc run` with the bundle's private copy left in place (runtime/artifact/bundle.py removes it at exit)
KEEP_COPY = ("import sys, runtime.artifact.bundle as b\n"
             "b.atexit = type('KeepCopy', (), {'register': staticmethod(lambda *a, **k: None)})\n"
             "from hgc import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


def hgc(argv: list[str], env: dict, keep_copy: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", KEEP_COPY] if keep_copy else [sys.executable, "-m", "hgc"]
    proc = subprocess.run(cmd + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"hgc {argv[0]} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return proc


def signature(ttir: Path) -> str:
    for line in ttir.read_text().splitlines():
        if "tt.func" in line:
            return line.strip()[:600]
    return ""


def compare(run_file: Path, bundle_file: Path) -> dict:
    """Metadata fields that differ, and the TTIR signatures where they differ."""
    a, b = json.loads(run_file.read_text()), json.loads(bundle_file.read_text())
    out = {"fields": {k: [str(a.get(k))[:200], str(b.get(k))[:200]] for k in sorted(set(a) | set(b))
                      if k != "hash" and a.get(k) != b.get(k)}}
    ta, tb = run_file.with_suffix(".ttir"), bundle_file.with_suffix(".ttir")
    if ta.exists() and tb.exists() and signature(ta) != signature(tb):
        out["ttir_signature"] = {"run": signature(ta), "bundle": signature(tb)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from testkit.helpers import tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bundle-keys-"))
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                HGC_HOME=str(work / "home"), TMPDIR=str(work / "tmp"))
    (work / "tmp").mkdir()

    def caches(name: str) -> dict:
        return {v: str(work / name / v.lower()) for v in
                ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")}

    tiny_checkpoint("qwen3_next", work / "c", seed=1, head_dim=64)
    hgc(["compile", str(work / "c"), "-o", str(work / "a"), "--target", "cuda", "--dtype", "bfloat16", "--inductor",
         "--decode-buckets", "1,2,4", "--extend-buckets", "64", "--no-dumps"], {**base, **caches("build")})
    proc = hgc(["run", str(work / "a"), "--prompt-ids", "1,2,3,4,5,6,7;9,10,11;12,13,14,15,16", "--max-new-tokens",
                "8", "--json", "--allow-kernel-builds"], {**base, **caches("run")}, keep_copy=True)
    report = json.loads(proc.stdout)["compiled"]
    (copy,) = (work / "tmp").glob("hgc-kernels-*")
    key = next(iter(json.loads((work / "a" / "manifest.json").read_text())["targets"]))
    bundle = work / "a" / "targets" / key / "kernels"
    held: dict[str, list[Path]] = {}
    for p in bundle.rglob("*.json"):
        held.setdefault(p.name, []).append(p)
    rows = []
    for name in report["built"]:  # Triton's builds are named by their group file, beside the kernel's metadata
        path = copy / name
        if not name.startswith("triton/") or not path.name.startswith("__grp__"):
            continue
        path = path.with_name(path.name[len("__grp__"):])
        twins = held.get(path.name, [])
        rows.append({"kernel": path.stem, "bundle_files_of_that_name": len(twins),
                     **({"vs_bundle": [compare(path, t) for t in twins]} if twins else {})})
    # kernels whose bundle copy matches in every metadata field and the TTIR signature, yet sits under
    # another key: the difference lies outside the kernel (the compile environment)
    equal = sum(1 for r in rows if any(not v["fields"] and "ttir_signature" not in v for v in r.get("vs_bundle", [])))
    doc = {"built_at_start_up": len(report["built"]), "with_an_equal_bundle_copy": equal, "triton_kernels": rows,
           "built_names": report["built"][:80]}
    text = json.dumps(doc, indent=1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bundle_keys_probe.json").write_text(text)
    print(text[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
