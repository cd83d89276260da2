"""Carry the GPU machine's kernel builds from one call to the next: FlashInfer's JIT modules and Triton's cache.

The GPU machine keeps nothing between leases, and the first use of each FlashInfer module and
Triton kernel builds it (about two minutes of a first eager run of a small model on an H200).
Both caches can live in the checkout instead of the home folder, so they travel:

    # on the GPU machine (benchmarks/gpu_call.sh does all of this):
    python3 benchmarks/jit_cache.py unpack .jitcache_parts   # the parts carried in, if any
    export FLASHINFER_WORKSPACE_BASE=$PWD/.jitcache TRITON_CACHE_DIR=$PWD/.jitcache/triton
    ...                                                       # the run itself
    python3 benchmarks/jit_cache.py pack --out $OUT           # jitcache.tar.gz.000, .001, ... under $OUT

    # here, after the call (FILES_AT: where the call's files came back):
    python benchmarks/jit_cache.py stash FILES_AT             # the parts into .jitcache_parts (git ignores it)

and the next call names `.jitcache_parts` in its `carry`, beside `.whl`. The parts travel
compressed (Triton's cache compresses about 6 to 1), since what travels with a call is limited
to 64 MiB, the wheels take 16 of it (the server's included) and the checkout itself about 21, and
a call whose carry passes the limit is refused before it starts. So pack measures what else
arrived (`carry_room`: every file of the checkout but the cache and its parts, a carried build
included) and takes the rest less a margin, 26 MiB at most; --max-mib overrides it.

What is packed: FlashInfer's built modules (`cached_ops/**.so`; not its object files or generated
sources), Triton's cache, and the Triton kernels and FlashInfer modules `hgc build` keeps for the
next build of its target (`hgc/build/<key>.seed/`, hgc/kernel_seed.py and flashinfer_seed.py), the
builds' first and newest first within each, each that still fits under --max-mib compressed (one
that would pass it stays behind). Triton's cache is taken a kernel folder at a time: Triton uses a
cached kernel only if every file its group lists is there, so half a folder is worth nothing. Parts
are at most 15 MiB each, since a returned file may not exceed 16 MiB. Timings from runs on a warm
cache say so: the graph benchmarks record whether `.jitcache` was present.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".jitcache"
PARTS = ROOT / ".jitcache_parts"
PART_BYTES = 15 << 20
PREFIX = "jitcache.tar.gz."
CARRY_BYTES = 64 << 20  # what travels with a call, at most: the checkout, the wheels, these parts
MARGIN_BYTES = 2 << 20  # for the files the next stop's work adds to the checkout
MAX_PARTS_BYTES = 26 << 20  # enough for a warm start of the bench builds (the timings above)
MIN_PARTS_BYTES = 4 << 20


def carry_room(root: Path) -> int:
    """Bytes the parts may take: CARRY_BYTES less every other file under root as the call found it
    (the checkout, the wheels, a carried build; not the cache, nor the parts the new ones replace),
    less MARGIN_BYTES, within MIN_PARTS_BYTES .. MAX_PARTS_BYTES."""
    skip = {root / CACHE.name, root / PARTS.name, root / ".git"}
    used = 0
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        subfolders[:] = [n for n in subfolders if here / n not in skip and n != "__pycache__"]
        used += sum((here / f).stat().st_size for f in files if (here / f).is_file())
    return max(MIN_PARTS_BYTES, min(MAX_PARTS_BYTES, CARRY_BYTES - MARGIN_BYTES - used))


def complete_kernel_folder(folder: Path) -> list[Path]:
    """The files of a Triton kernel folder, or [] unless every group file in it lists only files
    that are there. A folder missing its binary (a cache cut short) would load as a kernel
    without one and fail at launch, which is worse than a rebuild."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    groups = [p for p in files if p.name.startswith("__grp__")]
    if not groups:
        return []
    for g in groups:
        try:
            children = json.loads(g.read_text()).get("child_paths", {})
        except (OSError, ValueError):
            return []
        if not children or any(Path(c).name not in names for c in children.values()):
            return []
    return files


def cache_units(cache: Path) -> list[list[Path]]:
    """What is worth carrying, in units that are useful only whole (one Triton kernel folder, or
    one FlashInfer module): what `hgc build` keeps for the next build of a target first, since a
    build's capture is the longest wait of a call (205 of a 255 s build on an H100, 2026-12-07),
    then the runs' caches; newest first within each."""
    def newest_first(units):
        return sorted(units, key=lambda u: max(p.stat().st_mtime for p in u), reverse=True)

    def triton_units(folders):
        return [files for triton in folders if triton.is_dir()
                for d in triton.iterdir() if d.is_dir() and (files := complete_kernel_folder(d))]

    # the build seeds (hgc/kernel_seed.py, flashinfer_seed.py; gpu_call.sh points HGC_HOME under the cache)
    seeds = triton_units(cache.glob("hgc/build/*.seed/**/triton"))
    seeds += [[p] for p in cache.glob("hgc/build/*.seed/**/flashinfer/**/*.so") if p.is_file()]
    runs = triton_units([cache / "triton"])
    runs += [[p] for p in cache.glob(".cache/flashinfer/**/cached_ops/**/*.so") if p.is_file()]
    return newest_first(seeds) + newest_first(runs)


def _compressed_size(unit: list[Path]) -> int:
    """About what a unit adds to the packed stream: its files compressed as pack compresses them."""
    return sum(len(zlib.compress(p.read_bytes(), 6)) + 512 for p in unit)  # 512: a tar header


def pack(cache: Path, out: Path, max_bytes: int) -> int:
    """Units newest first, each that still fits under max_bytes compressed; one that would pass it
    stays behind (a newer module of tens of MiB would otherwise take the parts past what a carry
    may hold, and the next call would be refused)."""
    units, chosen, size, room = cache_units(cache), [], 0, max_bytes
    for unit in units:
        if room < 64 << 10:
            break
        raw = sum(p.stat().st_size for p in unit)
        # what compresses better than 8 to 1 is rare among built kernels: no need to measure it
        if raw > 8 * room or (packed := _compressed_size(unit)) > room:
            continue
        chosen.append(unit)
        room -= packed
        size += raw
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for unit in chosen:
            for p in unit:
                tar.add(p, arcname=str(p.relative_to(cache)))
    kept = len(chosen)
    data = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = [data[i: i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
    for i, part in enumerate(parts):
        (out / f"{PREFIX}{i:03d}").write_bytes(part)
    print(f"jit_cache: packed {kept} of {len(units)} kernel folders and modules ({size / 2**20:.1f} MiB, "
          f"{len(data) / 2**20:.1f} MiB compressed) into {len(parts)} part(s) under {out}"
          + (f"; left out {len(units) - kept} that would pass the {max_bytes / 2**20:.1f} MiB bound"
             if kept < len(units) else ""))
    return 0


def _parts(src: Path) -> list[Path]:
    """The packed parts in `src`, in order; none is said on stderr."""
    parts = sorted(src.glob(PREFIX + "*"))
    if not parts:
        print(f"jit_cache: no {PREFIX}NNN parts in {src}", file=sys.stderr)
    return parts


def unpack(src: Path, cache: Path) -> int:
    if not (parts := _parts(src)):
        return 2
    data = b"".join(p.read_bytes() for p in parts)
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(cache, filter="data")  # refuses absolute paths and links out of the folder
        names = tar.getnames()
    print(f"jit_cache: {len(names)} files into {cache} from {len(parts)} part(s)")
    return 0


def stash(src: Path, parts_dir: Path) -> int:
    """The parts a call brought back, in place of the ones carried before (a call packs its whole cache)."""
    if not (parts := _parts(src)):
        return 2
    tmp = parts_dir.with_name(parts_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in parts:
        shutil.copyfile(p, tmp / p.name)
    shutil.rmtree(parts_dir, ignore_errors=True)
    tmp.rename(parts_dir)
    print(f"jit_cache: {len(parts)} part(s) ({sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB) into {parts_dir}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="on the GPU machine: the cache into parts under --out")
    pk.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    pk.add_argument("--max-mib", type=int, default=None,
                    help="most MiB of compressed parts, newest units first (default: what the carry limit leaves "
                         "beside the checkout, 26 at most)")
    up = sub.add_parser("unpack", help="parts (carried in, or a call's returned files) into .jitcache")
    up.add_argument("src", type=Path)
    st = sub.add_parser("stash", help="here: a call's returned parts into .jitcache_parts, for the next carry")
    st.add_argument("src", type=Path)
    args = p.parse_args(argv)
    if args.command == "pack":
        return pack(CACHE, args.out, carry_room(ROOT) if args.max_mib is None else args.max_mib << 20)
    if args.command == "stash":
        return stash(args.src, PARTS)
    return unpack(args.src, CACHE)


if __name__ == "__main__":
    sys.exit(main())
