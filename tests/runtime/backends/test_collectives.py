"""runtime/backends/collectives.SymmMemAllReduce.path: which way a tensor is summed, from its byte
size and layout alone (the same on every rank), on CPU tensors; the sums themselves are checked on
two GPUs against NCCL (tests/gpu/test_gpu_collectives.py)."""

from __future__ import annotations

import torch

from runtime.backends.collectives import SymmMemAllReduce


def test_the_path_follows_size_words_alignment_and_layout():
    backend = SymmMemAllReduce(2, torch.empty(1024, dtype=torch.uint8), "unused")
    storage = torch.empty(1024, dtype=torch.bfloat16)
    base = storage[(-storage.data_ptr() % 16) // 2:]  # a view starting on the 16-byte grid
    assert backend.path(base[:512]) == "one_shot"  # 1024 bytes: the whole buffer
    assert backend.path(base[:513]) == "nccl"  # past the buffer
    assert backend.path(base[:3]) == "nccl"  # 6 bytes: not whole 4-byte words
    assert backend.path(base[1:9]) == "staged"  # 16 bytes, 2 bytes off the grid
    assert backend.path(base[:10]) == "staged"  # 20 bytes: words, not 16-byte vectors
    assert backend.path(base[:64].view(8, 8)[:, :4]) == "staged"  # not contiguous
    assert backend.path(base[:64].view(8, 8)) == "one_shot"
