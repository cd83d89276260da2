"""Carry the GPU machine's kernel builds from one call to the next: FlashInfer's JIT modules and Triton's cache.

The GPU machine keeps nothing between leases, and the first use of each FlashInfer module and
Triton kernel builds it (about two minutes of a first eager run of a small model on an H200).
Both caches can live in the checkout instead of the home folder, so they travel:

    # on the GPU machine, before anything imports flashinfer or triton:
    export FLASHINFER_WORKSPACE_BASE=$PWD/.jitcache TRITON_CACHE_DIR=$PWD/.jitcache/triton
    ...                                               # the run itself
    python3 benchmarks/jit_cache.py pack --out $OUT   # last: jitcache.tar.gz.000, .001, ... under $OUT

    # here, after the call (FILES_AT: where the call's files came back):
    python benchmarks/jit_cache.py unpack FILES_AT    # refills .jitcache (git ignores it)

and the next call names `.jitcache` in its `carry`, beside `.whl`.

What is packed: FlashInfer's built modules (`cached_ops/**.so`; not its object files or
generated sources) and every file of the Triton cache, newest first, up to --max-mib (what
travels with a call is limited; the wheels take 12 MiB of it). Parts are at most 15 MiB each,
since a returned file may not exceed 16 MiB. Timings from runs on a warm cache say so: the
graph benchmarks record whether `.jitcache` was present.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".jitcache"
PART_BYTES = 15 << 20
PREFIX = "jitcache.tar.gz."


def cache_files(cache: Path) -> list[Path]:
    """The files worth carrying, newest first."""
    picked = [p for p in (cache / "triton").rglob("*") if p.is_file()] if (cache / "triton").is_dir() else []
    picked += [p for p in cache.glob(".cache/flashinfer/**/cached_ops/**/*.so") if p.is_file()]
    return sorted(picked, key=lambda p: p.stat().st_mtime, reverse=True)


def pack(cache: Path, out: Path, max_bytes: int) -> int:
    files, kept, size = cache_files(cache), [], 0
    for p in files:
        n = p.stat().st_size
        if size + n <= max_bytes:
            kept.append(p)
            size += n
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for p in kept:
            tar.add(p, arcname=str(p.relative_to(cache)))
    data = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = [data[i: i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
    for i, part in enumerate(parts):
        (out / f"{PREFIX}{i:03d}").write_bytes(part)
    print(f"jit_cache: packed {len(kept)} of {len(files)} files ({size / 2**20:.1f} MiB, "
          f"{len(data) / 2**20:.1f} MiB compressed) into {len(parts)} part(s) under {out}"
          + (f"; left out {len(files) - len(kept)} older files over the {max_bytes >> 20} MiB bound"
             if len(kept) < len(files) else ""))
    return 0


def unpack(src: Path, cache: Path) -> int:
    parts = sorted(src.glob(PREFIX + "*"))
    if not parts:
        print(f"jit_cache: no {PREFIX}NNN parts in {src}", file=sys.stderr)
        return 2
    data = b"".join(p.read_bytes() for p in parts)
    cache.mkdir(exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(cache, filter="data")  # refuses absolute paths and links out of the folder
        names = tar.getnames()
    print(f"jit_cache: {len(names)} files into {cache} from {len(parts)} part(s)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="on the GPU machine: the cache into parts under --out")
    pk.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    pk.add_argument("--max-mib", type=int, default=40, help="most MiB of cache files to keep (newest first)")
    up = sub.add_parser("unpack", help="here: parts from a call's returned files into .jitcache")
    up.add_argument("src", type=Path)
    args = p.parse_args(argv)
    if args.command == "pack":
        return pack(CACHE, args.out, args.max_mib << 20)
    return unpack(args.src, CACHE)


if __name__ == "__main__":
    sys.exit(main())
