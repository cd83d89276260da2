"""benchmarks/jit_cache.py: the kernel caches that travel between GPU calls survive a pack and unpack,
the newest first when they do not all fit, a Triton kernel folder whole or not at all, and nothing
but built modules and Triton's cache goes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import jit_cache  # noqa: E402

KIB = 1024


def make_cache(cache: Path) -> dict:
    """Random (incompressible) files: two old Triton files in one kernel folder, a FlashInfer module
    and its object file, one new Triton file."""
    files = {"old_cubin": cache / "triton/ABC/old_kernel.cubin", "old_grp": cache / "triton/ABC/__grp__old_kernel.json",
             "so": cache / ".cache/flashinfer/0.6.0/90a/cached_ops/batch_decode/batch_decode.so",
             "new": cache / "triton/DEF/new_kernel.json"}
    files["obj"] = files["so"].with_name("batch_decode.cuda.o")
    files["new_grp"] = cache / "triton/DEF/__grp__new_kernel.json"
    for name, mtime in (("old_cubin", 1000), ("old_grp", 1000), ("so", 1001), ("obj", 1002), ("new", 1003)):
        p = files[name]
        p.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("_grp"):
            continue
        p.write_bytes(os.urandom(300 * KIB))
    # group files list their folder's files, as Triton's do
    files["old_grp"].write_text(json.dumps({"child_paths": {"c": str(files["old_cubin"])}}))
    files["new_grp"].write_text(json.dumps({"child_paths": {"j": str(files["new"])}}))
    for name, mtime in (("old_cubin", 1000), ("old_grp", 1000), ("so", 1001), ("obj", 1002), ("new", 1003),
                        ("new_grp", 1003)):
        os.utime(files[name], (mtime, mtime))
    return files


def unpacked(cache: Path, tmp_path: Path, max_bytes: int) -> list[str]:
    out, back = tmp_path / "out", tmp_path / "back"
    assert jit_cache.pack(cache, out, max_bytes=max_bytes) == 0
    assert jit_cache.unpack(out, back) == 0
    return sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file())


def test_pack_then_unpack_gives_back_the_newest_built_kernels(tmp_path):
    cache = tmp_path / "cache"
    files = make_cache(cache)
    # 700 KiB compressed: new (300) and the module (300) fit, the old folder would pass the bound
    got = unpacked(cache, tmp_path, 700 * KIB)
    assert got == sorted(str(files[n].relative_to(cache)) for n in ("so", "new", "new_grp"))
    assert (tmp_path / "back" / files["so"].relative_to(cache)).read_bytes() == files["so"].read_bytes()


def test_a_unit_that_would_pass_the_bound_stays_behind_and_older_ones_that_fit_go(tmp_path):
    # the parts must stay under what a carry may hold, whatever the newest unit weighs
    cache = tmp_path / "cache"
    files = make_cache(cache)
    big = cache / ".cache/flashinfer/0.6.0/90a/cached_ops/gdn_prefill/gdn_prefill.so"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(900 * KIB))  # the newest
    got = unpacked(cache, tmp_path, 700 * KIB)
    assert str(big.relative_to(cache)) not in got
    assert got == sorted(str(files[n].relative_to(cache)) for n in ("so", "new", "new_grp"))
    assert sum(p.stat().st_size for p in (tmp_path / "out").iterdir()) <= 700 * KIB


def test_a_triton_kernel_folder_travels_whole(tmp_path):
    cache = tmp_path / "cache"
    files = make_cache(cache)
    got = unpacked(cache, tmp_path, 4096 * KIB)
    assert got == sorted(str(files[n].relative_to(cache)) for n in ("old_cubin", "old_grp", "so", "new", "new_grp"))


def test_stash_replaces_the_carried_parts(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache)
    parts = tmp_path / "parts"
    (parts).mkdir()
    (parts / "jitcache.tar.gz.007").write_bytes(b"stale")
    assert jit_cache.pack(cache, tmp_path / "out", max_bytes=4096 * KIB) == 0
    assert jit_cache.stash(tmp_path / "out", parts) == 0
    assert sorted(p.name for p in parts.iterdir()) == ["jitcache.tar.gz.000"]


def test_unpack_without_parts_says_so(tmp_path, capsys):
    assert jit_cache.unpack(tmp_path, tmp_path / "c") == 2
    assert "no jitcache.tar.gz.NNN parts" in capsys.readouterr().err


def test_a_kernel_folder_missing_a_file_its_group_lists_stays_behind(tmp_path):
    cache = tmp_path / "cache"
    whole, cut = cache / "triton/AAA", cache / "triton/BBB"
    for folder in (whole, cut):
        folder.mkdir(parents=True)
        (folder / "k.json").write_text("{}")
        (folder / "k.cubin").write_bytes(b"\0" * 10)
        children = {"k.json": str(folder / "k.json"), "k.cubin": str(folder / "k.cubin")}
        (folder / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    (cut / "k.cubin").unlink()
    got = unpacked(cache, tmp_path, 4096 * KIB)
    assert got == sorted(["triton/AAA/k.json", "triton/AAA/k.cubin", "triton/AAA/__grp__k.json"])


def test_the_parts_take_what_the_carry_limit_leaves_beside_the_checkout(tmp_path):
    """carry_room: 64 MiB less every other file of the checkout (wheels and a carried build too, not
    the cache nor the parts being replaced), less the margin; 26 MiB at most, 4 at least."""
    MIB = 1 << 20
    (tmp_path / ".jitcache" / "triton").mkdir(parents=True)
    (tmp_path / ".jitcache" / "triton" / "big").write_bytes(b"\0" * (5 * MIB))
    (tmp_path / ".jitcache_parts").mkdir()
    (tmp_path / ".jitcache_parts" / "jitcache.tar.gz.000").write_bytes(b"\0" * (3 * MIB))
    assert jit_cache.carry_room(tmp_path) == 26 * MIB  # an empty checkout: the cap
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "w.whl").write_bytes(b"\0" * (16 * MIB))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "results.json").write_bytes(b"\0" * (21 * MIB + 512 * KIB))
    assert jit_cache.carry_room(tmp_path) == (64 - 2 - 16 - 21) * MIB - 512 * KIB
    (tmp_path / "build.so").write_bytes(b"\0" * (30 * MIB))
    assert jit_cache.carry_room(tmp_path) == 4 * MIB


def test_the_kernels_hgc_build_keeps_travel_as_triton_folders(tmp_path):
    # hgc/kernel_seed.py keeps a build's Triton folders in <key>.seed/triton (a rank's under rankN/);
    # gpu_call.sh points HGC_HOME under the cache, so the next call's build reads them
    cache = tmp_path / "cache"
    make_cache(cache)
    kept = [cache / "hgc/build/sm90-key.seed/triton/GHI", cache / "hgc/build/sm90-tp.seed/rank1/triton/JKL"]
    for folder in kept:
        folder.mkdir(parents=True)
        (folder / "k.cubin").write_bytes(os.urandom(KIB))
        (folder / "__grp__k.json").write_text(json.dumps({"child_paths": {"c": str(folder / "k.cubin")}}))
    # and its FlashInfer modules in <key>.seed/flashinfer (hgc/flashinfer_seed.py)
    module = cache / "hgc/build/sm90-key.seed/flashinfer/0.6.0/90a/cached_ops/prefill_x/prefill_x.so"
    module.parent.mkdir(parents=True)
    module.write_bytes(os.urandom(KIB))
    (cache / "hgc/signing.key").write_bytes(b"k" * 32)  # beside them, never packed
    got = unpacked(cache, tmp_path, 4096 * KIB)
    for folder in kept:
        assert {str((folder / n).relative_to(cache)) for n in ("k.cubin", "__grp__k.json")} <= set(got)
    assert str(module.relative_to(cache)) in got
    assert not any("signing" in name for name in got)


def test_what_a_build_keeps_goes_before_the_runs_caches_whatever_their_age(tmp_path):
    # a build's capture is the longest wait of a call: its seed travels first when not all fits
    cache = tmp_path / "cache"
    files = make_cache(cache)
    kept = cache / "hgc/build/sm90-key.seed/flashinfer/0.6.0/90a/cached_ops/prefill_x/prefill_x.so"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(os.urandom(300 * KIB))
    os.utime(kept, (999, 999))  # older than everything else
    got = unpacked(cache, tmp_path, 700 * KIB)
    want = [kept] + [files[n] for n in ("new", "new_grp")]
    assert got == sorted(str(p.relative_to(cache)) for p in want)
