"""Suite-wide settings, applied before any test module imports triton."""

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). The variable must
# be set before triton is first imported anywhere in the process, so it is set here, once.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
