"""The attention output gate kernel (runtime/backends/kernels/sigmoid_gate.py) against the traced glue's ops.

On a machine without CUDA the kernel runs in Triton's interpreter: CPU tests of its logic (the gate
read through the projection's strided view beside q, masked token blocks and channels, one head of
a [T, D] pair, both float dtypes), not of speed. The oracle is the traced glue's two ops, x *
sigmoid(gate), on fresh random inputs each check, compared by ||out - ref|| / ||ref|| (16-bit
outputs: the interpreter truncates where a GPU rounds to nearest, and its exp is not the card's).
On a GPU: tests/gpu/test_gpu_sigmoid_gate.py.
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels.sigmoid_gate import BLOCK_T, ROW_CHUNK, sigmoid_gate  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
# (heads, head dim): a small layer, a head dim that fills no power of two (masked channels), and
# bench qwen3_next's GQA layer
DIMS = [(2, 32), (3, 48), (16, 256)]


def gated_layer(T: int, H: int, D: int, dtype, seed: int):
    """The attention output [T, H, D] and the gate view of a projection's output [q | gate per head, k, v]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=g).to(dtype).to(DEVICE)
    qkv = (3 * torch.randn(T, H * 2 * D + 2 * D, generator=g)).to(dtype).to(DEVICE)
    gate = qkv[:, :H * 2 * D].view(T, H, 2 * D)[..., D:]
    return x, gate


@in_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("T", [1, BLOCK_T + 3])
def test_the_kernel_is_the_glues_two_ops(T, dims, dtype):
    H, D = dims
    x, gate = gated_layer(T, H, D, dtype, seed=T * 7 + D)
    assert not gate.is_contiguous()
    got = sigmoid_gate(x, gate)
    want = x * torch.sigmoid(gate)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got.float(), want.float()) <= TOL[dtype], (T, dims, dtype)


@in_process
def test_a_two_dimensional_pair_is_one_head_and_no_rows_is_nothing():
    x, gate = gated_layer(5, 1, 40, torch.float32, seed=3)
    x2, gate2 = x[:, 0], gate[:, 0]
    got = sigmoid_gate(x2, gate2)
    assert got.shape == (5, 40) and rel_err(got, x2 * torch.sigmoid(gate2)) <= TOL[torch.float32]
    empty = sigmoid_gate(x[:0], gate[:0])
    assert empty.shape == (0, 1, 40)


@in_process
@pytest.mark.parametrize("width,heads", [(2 * ROW_CHUNK, 2), (ROW_CHUNK + 64, 5), (ROW_CHUNK + 8, 1)])
def test_a_wide_two_dimensional_pair_runs_in_heads_of_at_most_row_chunk_channels(width, heads):
    """A [T, W] pair wider than ROW_CHUNK (Ling's Lightning gate: one row of every head's channels,
    the gate a view of a wider projection output) runs as heads of the largest power of two up to
    ROW_CHUNK dividing W (at least 64; else one head), and gives the two ops."""
    from testkit.sm90 import record

    g = torch.Generator().manual_seed(width)
    x = torch.randn(BLOCK_T + 3, width, generator=g).to(DEVICE)
    gate = (3 * torch.randn(BLOCK_T + 3, 2 * width, generator=g)).to(DEVICE)[:, width:]
    (launch,) = record(lambda: sigmoid_gate(x, gate))
    assert launch.grid == [2, heads] and launch.args["BLOCK_D"] == next_pow2(width // heads), launch
    got = sigmoid_gate(x, gate)
    assert got.shape == x.shape and rel_err(got, x * torch.sigmoid(gate)) <= TOL[torch.float32]


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@in_process
def test_refuses_shapes_dtypes_and_strided_channels():
    x, gate = gated_layer(4, 2, 32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="of one shape and dtype"):
        sigmoid_gate(x, gate[:, :1])
    with pytest.raises(ValueError, match="of one shape and dtype"):
        sigmoid_gate(x, gate.to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        sigmoid_gate(x, x.transpose(1, 2).contiguous().transpose(1, 2))
