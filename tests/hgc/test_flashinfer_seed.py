"""hgc/flashinfer_seed.py: a build loads the FlashInfer modules earlier builds of its target kept
through FlashInfer's AOT folder, and its folder (the bundle's) ends with the modules the process
loaded, from the seed or built, and no others. FlashInfer's module folders stand in for its
jit env here (the CPU machine has no FlashInfer); a real shared object is loaded, so the process's
map says what was loaded as it does on the GPU machine."""

from __future__ import annotations

import _json
import ctypes
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")  # kernel_seed's switch and bound
from hgc import flashinfer_seed, kernel_seed  # noqa: E402

SO = Path(_json.__file__)  # a real shared object, loadable without side effects


@pytest.fixture
def flashinfer(tmp_path, monkeypatch):
    """FlashInfer's jit env as a build sees it: its workspace under the build folder (fixed path)."""
    cache_dir = tmp_path / "build" / "flashinfer" / ".cache" / "flashinfer"
    env = SimpleNamespace(FLASHINFER_CACHE_DIR=cache_dir, FLASHINFER_JIT_DIR=cache_dir / "0.6.0" / "90a" / "cached_ops",
                          FLASHINFER_AOT_DIR=tmp_path / "site" / "data" / "aot")
    monkeypatch.setattr(flashinfer_seed, "_jit_env", lambda: env)
    monkeypatch.delenv(kernel_seed.FRESH_ENV, raising=False)
    return env, kernel_seed.seed_folder(tmp_path / "build") / "flashinfer"


def _build(env, name: str) -> Path:
    """What FlashInfer's ninja build leaves for module `name` (objects beside the module)."""
    so = Path(env.FLASHINFER_JIT_DIR) / name / f"{name}.so"
    so.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SO, so)
    (so.parent / "kernel.cuda.o").write_bytes(b"object")
    return so


def _load(env, name: str) -> None:
    """FlashInfer's build_and_load: the AOT folder's module as it is, else the built one."""
    aot = Path(env.FLASHINFER_AOT_DIR) / name / f"{name}.so"
    ctypes.CDLL(str(aot if aot.exists() else _build(env, name)))


def test_a_second_build_loads_the_first_builds_module_and_its_bundle_holds_it(flashinfer):
    env, seed = flashinfer
    modules = flashinfer_seed.use(seed)
    assert modules == (seed / "0.6.0" / "90a" / "cached_ops", env.FLASHINFER_JIT_DIR)
    assert env.FLASHINFER_AOT_DIR == modules[0]  # a module the seed holds loads from there
    _load(env, "prefill_a")  # nothing kept yet: built
    assert flashinfer_seed.take(*modules) == []
    assert "0 of 1 from earlier builds of this target, built: prefill_a" in flashinfer_seed.keep_and_say(*modules, [])
    assert (modules[0] / "prefill_a" / "prefill_a.so").read_bytes() == SO.read_bytes()

    shutil.rmtree(env.FLASHINFER_CACHE_DIR)  # the next build empties its folder
    _build(SimpleNamespace(FLASHINFER_JIT_DIR=modules[0]), "prefill_b")  # kept by another build, not loaded here
    modules = flashinfer_seed.use(seed)
    _load(env, "prefill_a")
    assert not (Path(env.FLASHINFER_JIT_DIR) / "prefill_a").exists()  # loaded from the seed, not built
    assert flashinfer_seed.take(*modules) == ["prefill_a"]
    # the build's folder holds what the process loaded and no other module: the bundle's
    assert sorted(p.name for p in Path(env.FLASHINFER_JIT_DIR).rglob("*.so")) == ["prefill_a.so"]
    line = flashinfer_seed.keep_and_say(*modules, ["prefill_a"])
    assert "1 of 1 from earlier builds of this target (prefill_a)" in line


def test_loaded_from_reads_the_process_map_not_the_folder(tmp_path):
    loaded, offered = tmp_path / "seed" / "a" / "a.so", tmp_path / "seed" / "b" / "b.so"
    for so in (loaded, offered):
        so.parent.mkdir(parents=True)
        shutil.copyfile(SO, so)
    ctypes.CDLL(str(loaded))
    assert flashinfer_seed.loaded_from(tmp_path / "seed") == {loaded.resolve()}
    assert flashinfer_seed.loaded_from(tmp_path / "elsewhere") == set()


def test_a_fresh_build_loads_nothing_from_the_seed_and_still_keeps_its_modules(flashinfer, monkeypatch):
    env, seed = flashinfer
    aot = env.FLASHINFER_AOT_DIR
    monkeypatch.setenv(kernel_seed.FRESH_ENV, "1")
    modules = flashinfer_seed.use(seed)
    assert env.FLASHINFER_AOT_DIR == aot
    _build(SimpleNamespace(FLASHINFER_JIT_DIR=modules[0]), "prefill_c")  # in the seed, but the build is fresh
    _load(env, "prefill_c")
    assert (Path(env.FLASHINFER_JIT_DIR) / "prefill_c" / "prefill_c.so").exists()
    assert flashinfer_seed.take(*modules) == []
    line = flashinfer_seed.keep_and_say(*modules, [])
    assert f"built ({kernel_seed.FRESH_ENV}=1): prefill_c" in line


def test_the_bound_drops_the_least_recently_used_module_never_one_the_build_has(tmp_path):
    build, seed = tmp_path / "build", tmp_path / "seed"
    for i, name in enumerate(("old", "newer")):
        so = seed / name / f"{name}.so"
        so.parent.mkdir(parents=True)
        so.write_bytes(b"\0" * 100)
        os.utime(so.parent, (1000 + i, 1000 + i))  # a module folder's use, as keep renews it
    mine = build / "mine" / "mine.so"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"\0" * 100)
    assert flashinfer_seed.keep(build, seed, max_bytes=200) == ["mine"]
    assert sorted(p.name for p in seed.glob("*/*.so")) == ["mine.so", "newer.so"]
    assert flashinfer_seed.keep(build, seed, max_bytes=50) == ["mine"]
    assert [p.name for p in seed.glob("*/*.so")] == ["mine.so"]
