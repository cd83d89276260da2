"""Suite-wide settings, applied before any test module imports triton."""

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). The variable must
# be set before triton is first imported anywhere in the process, so it is set here, once.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker process takes one core: intra-op threads of two workers on two
# cores would only contend. So do the processes a test starts (`hgc` commands, benchmark dry runs,
# lm-eval's harness) while the other worker runs: one intra-op thread each, unless a test says so.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite starts about 150 Python processes (`hgc` commands, servers, rank processes, benchmark dry
# runs), each importing most of the repo. Where the environment sets PYTHONDONTWRITEBYTECODE, every
# one of them compiled those sources again (about 25 s of the suite's CPU time on 2 cores); the
# suite's processes write and share the bytecode as an installed copy has it (__pycache__ is ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Inductor's first C++ build in a process picks the CPU's vector ISA by compiling a test library per
# ISA and loading each in a child Python that imports torch (about 9 s on 2 cores): every `hgc
# compile --inductor`, rank and worker process of the suite paid it again, for the answer the CPU's
# flags give. The suite takes the flags' answer (set before any process imports Inductor's config,
# which reads it once); tests/compiler/test_inductor_pieces.py builds and runs with the probe, whose
# libraries travel in a bundle like any kernel.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Tracing, export and compiling allocate objects by the million (FX nodes, fake tensors, sympy
# expressions): at CPython's default thresholds (700, 10, 10) the cyclic collector ran about 10,500
# times in tests/compiler/test_cuda_target.py, 11 of its 70 s on 2 cores. At (10000, 10, 10) every
# generation is collected 14 times less often per allocation: 1,800 collections, under 5 s, for
# about 15 MB more resident memory. (Freezing the objects of imports and collection changed nothing.)
gc.set_threshold(10_000, 10, 10)


def pytest_configure(config):
    """Under `-n auto --dist loadscope` a module is one unit of work, and pytest-xdist hands the
    units out in the order of the collection instead of its own (most tests first), so that
    pytest_collection_modifyitems decides it. Under Triton's interpreter, the interpreter runs with
    the suite's patches of it (testkit/triton_interpreter.py: the same results, in less time).
    Inductor's C++ compiles go through the run's compile cache (testkit/cxx_cache.py), made here by
    the process that starts the run (xdist's workers, and every process a test starts, inherit it)."""
    from testkit import cxx_cache

    if not hasattr(config, "workerinput") and cxx_cache.CACHE_DIR not in os.environ:
        folder = Path(tempfile.mkdtemp(prefix="hgc-test-cxx-"))
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))  # nothing outlives the run
        cxx_cache.install(folder)
    if getattr(config.option, "dist", None) == "loadscope" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        from testkit.triton_interpreter import install_interpreter_patches

        install_interpreter_patches()


@pytest.hookimpl(trylast=True)  # after -m has deselected the gpu tests
def pytest_collection_modifyitems(config, items):
    """Modules with a test marked slow first, then the others by their number of tests (xdist's own
    order). A slow module is a few tests, each a compile, an Inductor build, rank processes or a
    server: by test count they came last, and the last of them held one worker for a minute or two
    after the other had run out of work. Longest first, the end of the run is small modules."""
    if not hasattr(config, "workerinput"):  # the order only matters to xdist's workers
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules.values(), key=lambda tests: (not any(t.get_closest_marker("slow") for t in tests),
                                                         -len(tests)))
    items[:] = [item for tests in order for item in tests]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (and, on a shared 2-core machine,
    contention). Modules that use it run eager and compiled paths under the same setting, so
    their comparisons stay exact."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shared_traces():
    """Each checkpoint config traced once per process, every compile of the module (and of the
    other modules that use it) on a copy (testkit/traces.py). Not for a module that patches model
    code: the copies would be of the model as first traced."""
    from testkit.traces import shared_traces as one_trace_per_config

    with one_trace_per_config():
        yield


@pytest.fixture(scope="module")
def shared_loads():
    """Each program archive deserialized once per module, every load of it a copy (testkit/loads.py):
    for a module that loads one artifact again and again. Not for a module that patches
    torch.export.load or the deserializer."""
    from testkit.loads import shared_loads as one_deserialization_per_archive

    with one_deserialization_per_archive():
        yield


@pytest.fixture
def batch_invariant_installed():
    """runtime/backends/batch_invariant_aten.install() for one test (imported here, not at the top: a
    kernel module must not import triton before testkit/triton_interpreter.py has run); torch's own
    kernels are back after it, for the rest of the session."""
    from runtime.backends import batch_invariant_aten

    assert not batch_invariant_aten.installed()
    batch_invariant_aten.install()
    try:
        yield
    finally:
        batch_invariant_aten.uninstall()
