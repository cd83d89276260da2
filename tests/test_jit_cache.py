"""benchmarks/jit_cache.py: the kernel caches that travel between GPU calls survive a pack and unpack,
the newest files first when they do not all fit, and nothing but built modules and Triton's cache goes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import jit_cache  # noqa: E402


def test_pack_then_unpack_gives_back_the_built_kernels(tmp_path):
    cache = tmp_path / "cache"
    so = cache / ".cache/flashinfer/0.6.0/90a/cached_ops/batch_decode/batch_decode.so"
    obj = so.with_name("batch_decode.cuda.o")
    old = cache / "triton/ABC/old_kernel.cubin"
    new = cache / "triton/DEF/new_kernel.json"
    for p, size, mtime in ((old, 2000, 1000), (so, 3000, 1001), (obj, 5000, 1002), (new, 1000, 1003)):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
        os.utime(p, (mtime, mtime))
    out = tmp_path / "out"
    assert jit_cache.pack(cache, out, max_bytes=4500) == 0  # room for new (1000) and so (3000), not old
    back = tmp_path / "back"
    assert jit_cache.unpack(out, back) == 0
    got = sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file())
    assert got == sorted([str(so.relative_to(cache)), str(new.relative_to(cache))])
    assert (back / so.relative_to(cache)).read_bytes() == so.read_bytes()


def test_unpack_without_parts_says_so(tmp_path, capsys):
    assert jit_cache.unpack(tmp_path, tmp_path / "c") == 2
    assert "no jitcache.tar.gz.NNN parts" in capsys.readouterr().err
