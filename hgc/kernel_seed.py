"""Triton kernels an earlier build of the same target compiled, handed to the next build as it asks.

`hgc build` compiles a bundle's Triton kernels into an empty cache folder (build_command.py, step
1), so that what the folder holds afterwards is what this build used and the bundle copies exactly
that (step 4). The price is every kernel compiled again by every build: on an H100, capturing the 4
buckets of bench qwen3_next took 205 s of a 255 s `hgc compile` (Triton's compiles among
FlashInfer's JIT modules and FLA's autotuning), where a second capture in the same process takes
seconds; an A/B of two routing choices pays it twice.

The build folder's path is fixed (compiled kernels name it; Triton's group files list their files by
absolute path), so a kernel folder one build compiled there is valid, unchanged, for the next build
of the target. So a build's Triton folders are kept in a seed folder beside the build folder
(`<key>.seed/triton`, `seed_folder`): each compiled kernel as Triton finishes writing it, so a build
cut off by a time limit leaves what it compiled, the rest when the build ends (`keep`). The next
build's Triton cache reads through to it: when Triton asks its cache for a key the build's folder
lacks, the kept folder is copied in, whole, first (`SeededCacheManager`). The build's folder still
ends with the folders its build looked up and no others, so the bundle holds what it did before.

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
           "restore", "settings", "kept", "keep", "keep_and_say", "drop_least_recent"]

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
        self.seeded = not (override or dump)  # the cache proper (not Triton's debugging dump or override folders)
        if self.seeded:
            restore(key)
        super().__init__(key, override=override, dump=dump)

    def put_group(self, filename, group):
        """Triton's last write of a compiled kernel (its files are in place): the folder goes to the
        seed at once, not only when the build ends, so a build cut off by a time limit leaves what it
        compiled for the next one."""
        path = super().put_group(filename, group)
        if self.seeded and (seed := os.environ.get(SEED_ENV)):
            _copy_whole(Path(self.cache_dir), Path(seed) / Path(self.cache_dir).name)
        return path


def restore(key: str) -> bool:
    """Copy the seed's folder of `key` into the build's Triton cache if the cache lacks it (whole or
    not at all: `_copy_whole`); whether it did."""
    seed, cache = os.environ.get(SEED_ENV), knobs.cache.dir  # the folder FileCacheManager uses
    if not seed or not cache or os.environ.get(FRESH_ENV) == "1":
        return False
    src, dest = Path(seed) / key, Path(cache) / key
    if not src.is_dir() or not _copy_whole(src, dest):
        return False
    os.utime(src)  # used now: the bound keeps recently used folders
    return True


def _copy_whole(src: Path, dest: Path) -> bool:
    """Copy folder src to dest unless dest exists; under a temporary name, renamed, so a reader (a
    concurrent lookup, a compile worker) sees dest whole or not at all. Whether it copied. A copy
    that fails (another process put dest there first, a full disk) leaves nothing: the seed only
    saves time, so it never fails a build."""
    if dest.exists():
        return False
    tmp = dest.parent / f".copying.{dest.name}.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("tmp.pid_*"))  # Triton's unfinished writes
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def settings(seed: Path) -> dict[str, str]:
    """The environment under which Triton's lookups read through to `seed`: what build_command.py sets
    around a build beside the build's own TRITON_CACHE_DIR (compiler/splitops/bundle.py cache_env)."""
    return {"TRITON_CACHE_MANAGER": MANAGER, SEED_ENV: str(seed)}


def keep_and_say(cache: Path, seed: Path, before: set[str]) -> str:
    """`keep`, and the build's line about it."""
    used, known = keep(cache, seed, before)
    if os.environ.get(FRESH_ENV) == "1":
        return f"Triton kernels: {used} compiled anew ({FRESH_ENV}=1), kept under {seed}"
    return f"Triton kernels: {known} of {used} from earlier builds of this target, the rest kept under {seed}"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def kept(seed: Path) -> set[str]:
    """The kernel folders the seed holds (taken before a build: what it can read)."""
    return {p.name for p in seed.iterdir() if p.is_dir() and not p.name.startswith(".")} if seed.is_dir() else set()


def keep(cache: Path, seed: Path, before: set[str], max_bytes: int = SEED_MAX_BYTES) -> tuple[int, int]:
    """After a build: copy the folders of its Triton cache that the seed lacks into it (the compiled
    kernels are there already, `put_group`; autotuning records and Triton's own libraries are not),
    mark the others used, then drop the least recently used folders while the seed passes max_bytes
    (never one this build used). Returns (folders the build used, of them in the seed `before` it)."""
    seed.mkdir(parents=True, exist_ok=True)
    used = {p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")}
    for name in sorted(used):
        if not _copy_whole(cache / name, seed / name) and (seed / name).exists():
            os.utime(seed / name)
    drop_least_recent(seed, used, max_bytes)
    return len(used), len(used & before)


def drop_least_recent(seed: Path, used: set[str], max_bytes: int) -> None:
    """The bound of a seed whose entries are its folders (a Triton key's, a FlashInfer module's): the
    folders used longest ago (their mtime, which a use renews) go first while the seed passes
    max_bytes, never one named in `used` (the build's own)."""
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
