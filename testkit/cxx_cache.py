"""The test run's cache of Inductor's C++ compiles: a compile of the same sources with the same flags
runs g++ once per run, whichever test, process or pytest-xdist worker asks first; the others copy its
library.

Each Inductor build compiles into a cache folder of its own (a bundle carries what its build made), so
Inductor's own cache never finds another build's libraries: every `hgc compile --inductor` process
compiled the CPU's vector-ISA probe again, two tensor-parallel ranks compiled the same shard's glue
side by side, and modules built the same small pieces as others (a clean run: 89 builds, about 187 s
of g++ on 2 cores; the tensor-parallel build alone went from 87 to 53 s).

`install(folder)` (tests/conftest.py, once per run) writes a `g++` script into the run's folder and
puts the folder first on PATH, which every process the suite starts inherits. The folder goes when the
run ends: nothing outlives the run.

The key: the real compiler, every argument but the output's path, and the bytes of every file an
argument names (sources, the precompiled header's header) in place of its path (each build's sources
lie in its own folder, named by their content's hash). Inductor's sources include torch's headers
only, which one run does not change. A copy differs from a fresh compile in one thing: its debug line
tables (-g1) name the folder of the build that compiled it. A command that makes no library (`-E`, a
precompiled header, `--version`) runs g++ itself.

A compile of Inductor's C++ wrapper code takes a precompiled WRAPPER_HEADER of the run's, made once
per set of flags (`_wrapper_header`): the tensor-parallel module's eight pieces went from about 7.5 to
2.5 s each (the build from 87 to 44 s).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import stat
import sys
import time
from pathlib import Path

REAL_CXX = "HGC_TEST_REAL_CXX"
CACHE_DIR = "HGC_TEST_CXX_CACHE"


def install(folder: Path) -> None:
    """PATH -> a `g++` script in `folder` first, which runs this module with the g++ found before it.

    Inductor runs `g++` (CXX unset) by name: its cache keys and precompiled headers name the compiler
    as they did, so what it keeps in its default cache folder stays valid (a CXX of this run's path
    would have keyed a new 150 MB precompiled header there each run)."""
    real = shutil.which("g++")
    if real is None or os.environ.get("CXX"):  # no g++, or one of the user's: Inductor's own way
        return
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    script = folder / "bin" / "g++"
    module = Path(__file__).resolve()
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(module))} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ.update({REAL_CXX: real, CACHE_DIR: str(folder),
                       "PATH": os.pathsep.join([str(script.parent), os.environ.get("PATH", "")])})


def _output(args: list[str]) -> str | None:
    """The library the command writes, None for a command that writes none (or several)."""
    if args.count("-o") != 1 or "-E" in args or "-c" in args:
        return None
    out = args[args.index("-o") + 1]
    return out if out.endswith(".so") else None


def _key(real: str, args: list[str], out: str) -> str:
    digest = hashlib.sha256(real.encode())
    for arg in args:
        if arg == out:
            arg = "<output>"
        elif os.path.isfile(arg):
            arg = "<file " + hashlib.sha256(Path(arg).read_bytes()).hexdigest() + ">"
        digest.update(arg.encode() + b"\0")
    return digest.hexdigest()


def _log(line: str) -> None:
    """One line per library in the run's folder (compile.log): what the cache saved, for whoever asks."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]  # inherited from the test that started it
    with open(Path(os.environ[CACHE_DIR]) / "compile.log", "a") as f:
        f.write(f"{line} {test}\n")


def _real_cxx() -> str:
    """The g++ this script stands in front of; for a process whose environment lost the run's
    variables, the first g++ on PATH that is not such a script."""
    if os.environ.get(REAL_CXX):
        return os.environ[REAL_CXX]
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = Path(folder or ".") / "g++"
        if found.is_file() and os.access(found, os.X_OK) and Path(__file__).name.encode() not in found.read_bytes():
            return str(found)
    return "/usr/bin/g++"


# Inductor's C++ wrapper code starts every source with this header (ATen's vector code among it: about
# half of a piece's compile on 2 cores). Hgc's builds compile without precompiled headers
# (compiler/splitops/bundle.py INDUCTOR_CONFIG: a bundle must not need one where it loads); the test
# run's compiles take one of their own, made once a run per set of flags (`_with_wrapper_header`).
WRAPPER_HEADER = "#include <torch/csrc/inductor/cpp_wrapper/cpu.h>"
# Arguments of the link, not of the header's compile.
_LINK_ONLY = ("-shared", "-l", "-L")


def _wrapper_header(real: str, args: list[str], source: str) -> str | None:
    """The run's precompiled WRAPPER_HEADER for the compile `args` of `source` (None: the source does
    not start with it, the command already includes a header, or the header did not compile).

    Compiled with the command's own flags (all but the source, the output and the link's), so g++
    takes it where it would have parsed the header (-Winvalid-pch says so where it would not); the
    header's include guard makes the source's own #include of it a no-op. The library is the one
    the command makes without it."""
    if "-include" in args:
        return None
    with open(source, errors="replace") as f:
        if f.readline().strip() != WRAPPER_HEADER and f.readline().strip() != WRAPPER_HEADER:
            return None
    out = args[args.index("-o") + 1]
    flags = [a for a in args if a not in (source, out, "-o") and not a.startswith(_LINK_ONLY)]
    digest = hashlib.sha256("\0".join([real, *flags]).encode()).hexdigest()[:16]
    folder = Path(os.environ[CACHE_DIR]) / "headers" / digest
    header, compiled = folder / "wrapper.h", folder / "wrapper.h.gch"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not compiled.is_file() and not (folder / "failed").is_file():
            header.write_text(WRAPPER_HEADER + "\n")
            code = os.spawnv(os.P_WAIT, real, [real, "-x", "c++-header", str(header), *flags, "-o", f"{compiled}.part"])
            if code == 0:
                os.replace(f"{compiled}.part", compiled)
                _log(f"precompiled {digest} wrapper.h")
            else:
                (folder / "failed").touch()
                _log(f"precompiling {digest} wrapper.h failed ({code}): compiles without it")
    return str(header) if compiled.is_file() else None


def main(args: list[str]) -> int:
    real = _real_cxx()
    out = _output(args)
    if out is None or not os.environ.get(CACHE_DIR) or not Path(os.environ[CACHE_DIR]).is_dir():
        os.execvp(real, [real, *args])
    began = time.perf_counter()
    entry = Path(os.environ[CACHE_DIR]) / "libraries" / _key(real, args, out)
    entry.parent.mkdir(exist_ok=True)
    with open(f"{entry}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the same compile elsewhere: wait for it and copy its library
        if not entry.is_file():
            sources = [a for a in args if a.endswith(".cpp") and os.path.isfile(a)]
            header = _wrapper_header(real, args, sources[0]) if len(sources) == 1 else None
            code = os.spawnv(os.P_WAIT, real, [real, *args, *(["-include", header, "-Winvalid-pch"] if header else [])])
            if code != 0:
                return code
            shutil.copyfile(out, f"{entry}.part")
            os.replace(f"{entry}.part", entry)
            _log(f"compiled {entry.name[:16]} {Path(out).name} {time.perf_counter() - began:.2f} s")
            return 0
    part = f"{out}.part{os.getpid()}"  # a new file put in place whole, as the linker writes one
    shutil.copyfile(entry, part)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(part, 0o777 & ~umask)  # the linker's mode for a library
    os.replace(part, out)
    _log(f"copied {entry.name[:16]} {Path(out).name} {time.perf_counter() - began:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
