"""FlashInfer modules an earlier build of the same target built, loaded by the next build as they are.

FlashInfer builds each module it is asked for with nvcc (its JIT: `cached_ops/<name>/<name>.so`
under its workspace), and `hgc build` points that workspace at an empty folder of the build's, so
that the bundle holds exactly the modules its build loaded (build_command.py). Every build of a
target so compiled its modules again: bench qwen3_next's GQA prefill in every cuda build, and GDN's
chunked prefill (`chunk_impl=flashinfer`) about two minutes more.

A module's name is FlashInfer's own cache key (its kind, dtypes, head dims and options; the version
and the architectures are the workspace's folders above it), and FlashInfer loads a module found in
its AOT folder as it is, building nothing: the same rule the run uses to load a bundle's modules
(runtime/artifact/bundle.py). So a cuda build keeps the modules it loaded in a seed folder beside
the build folder (`<key>.seed/flashinfer/<version>/<architectures>/<name>/<name>.so`, beside
kernel_seed.py's Triton folders), and the next build points FlashInfer's AOT folder at the seed
(`use`): a module the seed holds loads from there, any other is built into the build's folder as
before. After the start-up, the modules the process mapped from the seed (/proc/self/maps: what was
loaded, not what the seed offered) are copied into the build's folder (`take`), so the bundle holds
what it held before; then the build's modules go to the seed (`keep`). HGC_FRESH_KERNELS=1 builds
every module anew; the seed is bounded like the Triton seed (least recently used out).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from hgc.kernel_seed import FRESH_ENV, SEED_MAX_BYTES, drop_least_recent  # one switch, one bound

__all__ = ["use", "loaded_from", "take", "keep", "keep_and_say"]


def _jit_env():
    try:
        from flashinfer.jit import env as jit_env
    except ImportError:  # no FlashInfer here: no backend will ask for one of its modules
        return None
    return jit_env


def use(seed: Path) -> tuple[Path, Path] | None:
    """Point this process's FlashInfer at `seed` for the modules it holds (unless HGC_FRESH_KERNELS=1):
    (the seed's module folder, the build's), or None where FlashInfer is absent. Imports FlashInfer:
    call it with the build's workspace set (FLASHINFER_WORKSPACE_BASE, read once at import)."""
    jit_env = _jit_env()
    if jit_env is None:
        return None
    # the version and architecture folders of the workspace, so a seed never offers another's module
    folder = seed / Path(jit_env.FLASHINFER_JIT_DIR).relative_to(jit_env.FLASHINFER_CACHE_DIR)
    if os.environ.get(FRESH_ENV) != "1":
        jit_env.FLASHINFER_AOT_DIR = folder
    return folder, Path(jit_env.FLASHINFER_JIT_DIR)


def loaded_from(folder: Path, maps: Path = Path("/proc/self/maps")) -> set[Path]:
    """The shared objects under `folder` this process has mapped."""
    root = str(folder.resolve()) + os.sep
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return set()
    paths = (line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6)
    return {Path(p) for p in paths if p.startswith(root) and p.endswith(".so")}


def take(seed_modules: Path, build_modules: Path) -> list[str]:
    """Copy each module this process loaded from the seed into the build's module folder, at the
    path FlashInfer would have built it (`<name>/<name>.so`); the names taken."""
    taken = []
    for so in sorted(loaded_from(seed_modules)):
        rel = so.relative_to(seed_modules.resolve())
        if _copy_file(so, build_modules / rel):
            taken.append(rel.parent.name)
    return taken


def keep(build_modules: Path, seed_modules: Path, max_bytes: int = SEED_MAX_BYTES) -> list[str]:
    """After a build: its modules into the seed (those it took from there marked used), then the Triton
    seed's bound over the module folders (`drop_least_recent`); the names of the build's modules."""
    modules = sorted(p.relative_to(build_modules) for p in build_modules.glob("*/*.so"))  # <name>/<name>.so
    for rel in modules:
        if not _copy_file(build_modules / rel, seed_modules / rel) and (seed_modules / rel).exists():
            os.utime(seed_modules / rel.parent)  # used now: the bound keeps recently used folders
    names = [rel.parent.name for rel in modules]
    if seed_modules.is_dir():
        drop_least_recent(seed_modules, set(names), max_bytes)
    return names


def keep_and_say(seed_modules: Path, build_modules: Path, taken: list[str]) -> str:
    """`keep`, and the build's line about its modules."""
    names = keep(build_modules, seed_modules)
    built = [n for n in names if n not in taken]
    fresh = f" ({FRESH_ENV}=1)" if os.environ.get(FRESH_ENV) == "1" else ""
    return (f"FlashInfer modules: {len(taken)} of {len(names)} from earlier builds of this target"
            + (f" ({', '.join(taken)})" if taken else "") + (f", built{fresh}: {', '.join(built)}" if built else "")
            + f"; kept under {seed_modules}")


def _copy_file(src: Path, dest: Path) -> bool:
    """Copy src to dest unless dest exists, under a temporary name renamed into place, so a reader
    finds dest whole or not at all; whether it copied. A failed copy leaves nothing and fails nothing:
    the seed only saves time."""
    if dest.exists():
        return False
    tmp = dest.parent / f".copying.{dest.name}.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, tmp)
        os.rename(tmp, dest)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True
