"""Triton kernels an earlier build of the same target compiled, handed to the next build as it asks.

`hgc build` compiles a bundle's Triton kernels into an empty cache folder (build_command.py, step
1), so that what the folder holds afterwards is what this build used and the bundle copies exactly
that (step 4). The price is every kernel compiled again by every build: on an H100, capturing the 4
buckets of bench qwen3_next took 205 s of a 255 s `hgc compile` (Triton's compiles among FlashInfer's
JIT modules and FLA's autotuning), where a second capture in the same process takes seconds; an A/B
of two routing choices pays it twice.

The build folder's path is fixed (compiled kernels name it; Triton's group files list their files
by absolute path), so a kernel folder one build compiled there is valid, unchanged, for the next
build of the target. So after each build its Triton folders are kept in a seed folder beside the
build folder (`<key>.seed/triton`, `seed_folder`), and the next build's Triton cache reads through
to it: when Triton asks its cache for a key the build's folder lacks, the kept folder is copied in,
whole, first (`SeededCacheManager`). The build's folder still ends with the folders its build looked
up and no others, so the bundle holds what it did before.

Triton takes its cache manager from TRITON_CACHE_MANAGER (MODULE:CLASS), read at each lookup, in the
build's process and in Inductor's compile workers, which inherit the environment (`settings`). A hit
is decided by Triton's key as in any long-lived cache: the kernel's source, constants and options,
Triton's version and the backend's (ptxas, the arch). An autotuned kernel's kept choice
(TRITON_CACHE_AUTOTUNING) is the earlier build's timing. HGC_FRESH_KERNELS=1 compiles every kernel
anew (the seed is still kept for later builds). The seed is bounded (SEED_MAX_BYTES): past it, the
folders no build has used for longest go first.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from triton import knobs
from triton.runtime.cache import FileCacheManager

__all__ = ["SEED_ENV", "FRESH_ENV", "MANAGER", "SEED_MAX_BYTES", "SeededCacheManager", "seed_folder",
           "restore", "settings", "keep", "keep_and_say"]

SEED_ENV = "HGC_KERNEL_SEED"  # the seed's Triton folder, set for a build by `settings`
FRESH_ENV = "HGC_FRESH_KERNELS"  # "1": the build reads nothing from the seed
MANAGER = f"{__name__}:SeededCacheManager"
SEED_MAX_BYTES = 4 << 30  # a bound on the disk the seed may take


def seed_folder(work: Path) -> Path:
    """Where the builds that use build folder `work` keep their kernels: beside it, so it moves with
    HGC_HOME, and outside it, since each build empties `work`."""
    return work.parent / f"{work.name}.seed"


class SeededCacheManager(FileCacheManager):
    """Triton's file cache with a read-through to the seed: a key's folder missing from the cache is
    copied in from the seed before Triton looks in it."""

    def __init__(self, key, override=False, dump=False):
        if not (override or dump):  # the cache proper (not Triton's debugging dump or override folders)
            restore(key)
        super().__init__(key, override=override, dump=dump)


def restore(key: str) -> bool:
    """Copy the seed's folder of `key` into the build's Triton cache if the cache lacks it; whether
    it did. Copied under a temporary name and renamed, so a concurrent lookup (a compile worker)
    sees the folder whole or not at all."""
    seed, cache = os.environ.get(SEED_ENV), knobs.cache.dir  # the folder FileCacheManager uses
    if not seed or not cache or os.environ.get(FRESH_ENV) == "1":
        return False
    src, dest = Path(seed) / key, Path(cache) / key
    if dest.exists() or not src.is_dir():
        return False
    tmp = Path(cache) / f".restoring.{key}.{os.getpid()}.{uuid.uuid4().hex}"
    shutil.copytree(src, tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process restored or created it first: theirs stands
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    os.utime(src)  # used now: the bound keeps recently used folders
    return True


def settings(seed: Path) -> dict[str, str]:
    """The environment under which Triton's lookups read through to `seed`: what build_command.py sets
    around a build beside the build's own TRITON_CACHE_DIR (compiler/splitops/bundle.py cache_env)."""
    return {"TRITON_CACHE_MANAGER": MANAGER, SEED_ENV: str(seed)}


def keep_and_say(cache: Path, seed: Path) -> str:
    """`keep`, and the build's line about it."""
    used, known = keep(cache, seed)
    if os.environ.get(FRESH_ENV) == "1":
        return f"Triton kernels: {used} compiled anew ({FRESH_ENV}=1), kept under {seed}"
    return f"Triton kernels: {known} of {used} from earlier builds of this target, the rest kept under {seed}"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def keep(cache: Path, seed: Path, max_bytes: int = SEED_MAX_BYTES) -> tuple[int, int]:
    """After a build: copy the folders of its Triton cache that the seed lacks into it, mark the
    others used, then drop the least recently used folders while the seed passes max_bytes (never
    one this build used). Returns (folders the build used, of them already in the seed)."""
    seed.mkdir(parents=True, exist_ok=True)
    used, known = set(), 0
    for folder in sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")):
        used.add(folder.name)
        kept = seed / folder.name
        if kept.exists():
            known += 1
            os.utime(kept)
            continue
        tmp = seed / f".keeping.{folder.name}.{uuid.uuid4().hex}"
        shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns("tmp.pid_*"))  # Triton's unfinished writes
        try:
            os.rename(tmp, kept)
        except OSError:  # another build kept it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    folders = sorted((p for p in seed.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime)
    sizes = {p: _size(p) for p in folders}
    total = sum(sizes.values())
    for p in folders:
        if total <= max_bytes:
            break
        if p.name not in used:
            shutil.rmtree(p, ignore_errors=True)
            total -= sizes[p]
    return len(used), known
