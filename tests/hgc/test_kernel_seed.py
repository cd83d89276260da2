"""hgc/kernel_seed.py: a build's Triton cache reads through to the kernels earlier builds of the
target kept, through Triton's own cache-manager lookup, and keeps the folder's content as Triton
left it (its group file names files by absolute path, valid because the build folder never moves)."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

pytest.importorskip("triton")
from triton.runtime.cache import get_cache_manager  # noqa: E402

from compiler.splitops.bundle import cache_env  # noqa: E402
from hgc import kernel_seed  # noqa: E402


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _compile_into(cache, key: str, body: bytes) -> None:
    """What Triton's compile leaves for one kernel: its files and the group file naming them."""
    manager = get_cache_manager(key)
    paths = {name: manager.put(body + name.encode(), name) for name in ("k.cubin", "k.json")}
    manager.put_group("k.json", paths)


@pytest.fixture
def build(tmp_path, monkeypatch):
    """One build folder (fixed path) and its seed beside it, Triton's cache pointed at the former."""
    cache = tmp_path / "build" / "triton"
    seed = kernel_seed.seed_folder(tmp_path / "build") / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    monkeypatch.delenv(kernel_seed.FRESH_ENV, raising=False)
    cache.mkdir(parents=True)
    return cache, seed


def test_a_second_build_finds_the_first_builds_kernel_through_tritons_lookup(build):
    cache, seed = build
    _compile_into(cache, _key("kernel a"), b"a")
    assert kernel_seed.keep(cache, seed, set()) == (1, 0)
    shutil.rmtree(cache)  # the next build empties its folder (build_command.py step 1)
    cache.mkdir()
    before = kernel_seed.kept(seed)

    with cache_env({"triton": cache}, kernel_seed.settings(seed)):
        assert os.environ["TRITON_CACHE_MANAGER"] == kernel_seed.MANAGER
        group = get_cache_manager(_key("kernel a")).get_group("k.json")
        missing = get_cache_manager(_key("kernel b")).get_group("k.json")
    assert "TRITON_CACHE_MANAGER" not in os.environ  # restored after the block
    assert group is not None and missing is None
    assert {open(p, "rb").read() for p in group.values()} == {b"ak.cubin", b"ak.json"}
    assert all(p.startswith(str(cache)) for p in group.values())
    # the build's cache holds what it looked up: the restored folder, and b's empty one Triton made
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        get_cache_manager(_key(t)).key for t in ("kernel a", "kernel b"))
    assert not any(cache.glob(".restoring*"))
    # this build's lookups counted: the folder it got from the seed
    assert kernel_seed.keep(cache, seed, before) == (2, 1)


def test_fresh_kernels_read_nothing_from_the_seed(build, monkeypatch):
    cache, seed = build
    _compile_into(cache, _key("kernel a"), b"a")
    kernel_seed.keep(cache, seed, set())
    shutil.rmtree(cache)
    cache.mkdir()
    monkeypatch.setenv(kernel_seed.FRESH_ENV, "1")
    with cache_env({"triton": cache}, kernel_seed.settings(seed)):
        assert get_cache_manager(_key("kernel a")).get_group("k.json") is None
    assert "compiled anew" in kernel_seed.keep_and_say(cache, seed, kernel_seed.kept(seed))


def test_a_folder_the_cache_has_is_left_as_it_is(build):
    cache, seed = build
    _compile_into(cache, _key("kernel a"), b"old")
    kernel_seed.keep(cache, seed, set())
    shutil.rmtree(cache)
    cache.mkdir()
    _compile_into(cache, _key("kernel a"), b"new")  # compiled by this build before any lookup read the seed
    with cache_env({"triton": cache}, kernel_seed.settings(seed)):
        group = get_cache_manager(_key("kernel a")).get_group("k.json")
    assert {open(p, "rb").read() for p in group.values()} == {b"newk.cubin", b"newk.json"}


def test_the_seed_is_bounded_least_recently_used_first_never_what_the_build_used(build):
    cache, seed = build
    for i, name in enumerate(("old", "older_used", "new")):
        folder = seed / name
        folder.mkdir(parents=True)
        (folder / "f").write_bytes(b"x" * 1000)
        when = 1_000_000 + {"older_used": 0, "old": 10, "new": 20}[name]
        os.utime(folder, (when, when))
    (cache / "older_used").mkdir()  # this build used it (restored, or compiled the same)
    (cache / "older_used" / "f").write_bytes(b"x" * 1000)
    assert kernel_seed.keep(cache, seed, kernel_seed.kept(seed), max_bytes=2500) == (1, 1)
    assert sorted(p.name for p in seed.iterdir()) == ["new", "older_used"]
    assert (seed / "older_used").stat().st_mtime > 1_000_020  # marked used: the newest now


def test_a_kernel_goes_to_the_seed_as_triton_finishes_writing_it(build):
    # a build cut off by a time limit runs no `keep`: what it compiled is in the seed already
    cache, seed = build
    with cache_env({"triton": cache}, kernel_seed.settings(seed)):
        _compile_into(cache, _key("kernel a"), b"a")
    folder = seed / get_cache_manager(_key("kernel a")).key
    assert sorted(p.name for p in folder.iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]
    assert not any(p.name.startswith(".") for p in seed.iterdir())
