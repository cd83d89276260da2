"""Suite-wide settings, applied before any test module imports triton."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). The variable must
# be set before triton is first imported anywhere in the process, so it is set here, once.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker process takes one core: intra-op threads of two workers on two
# cores would only contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (and, on a shared 2-core machine,
    contention). Modules that use it run eager and compiled paths under the same setting, so
    their comparisons stay exact."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
