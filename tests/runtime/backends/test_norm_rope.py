"""The q / k norm and partial rotary kernel (runtime/backends/kernels/norm_rope.py) against the model's ops.

On a machine without CUDA the kernel runs in Triton's interpreter: CPU tests of its logic (the
pairs of NeoX and GPT-J rotations, the unrotated channels, unit-offset and plain scales, q's heads
read through the projection's strided view beside its gates, k's heads after them, masked token
blocks), not of speed. The oracle is models/common.py: `RMSNorm` then `apply_rotary`, what the
traced glue runs, on fresh random inputs each check, compared by ||out - ref|| / ||ref|| (16-bit
outputs: the interpreter truncates where a GPU rounds to nearest, so a value may differ by one unit).
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from models.common import RMSNorm, apply_rotary, rope_inv_freq  # noqa: E402
from runtime.backends.kernels.norm_rope import BLOCK_T, qk_norm_rope  # noqa: E402
from testkit.helpers import assert_one_line_error  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (q heads, k heads, head dim, rotary dim): a small layer, a head dim that fills no power of two
# (masked channels), and bench qwen3_next's GQA layer
DIMS = [(2, 1, 32, 8), (3, 3, 48, 16), (16, 2, 256, 64)]


def layer(T: int, dims, dtype, seed: int):
    """A projection's output row [q | gate per head, k, v] and the views the layer takes of it."""
    H, Hk, D, _ = dims
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, H * 2 * D + 2 * Hk * D, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :H * 2 * D].view(T, H, 2 * D)[..., :D]
    k = qkv[:, H * 2 * D:H * 2 * D + Hk * D].view(T, Hk, D)
    wq, wk = ((0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    positions = torch.randint(0, 40000, (T,), generator=g).to(DEVICE)
    return q, k, wq, wk, positions


def model_ops(x, weight, positions, rotary_dim, theta, eps, unit_offset, interleaved):
    norm = RMSNorm(x.shape[-1], eps, unit_offset=unit_offset).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        return apply_rotary(norm(x), positions, rotary_dim, theta, interleaved=interleaved)


@in_process
@pytest.mark.parametrize("dims", DIMS, ids=["small", "odd", "bench"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_q_and_k_are_the_models_norm_and_rotary(dims, dtype, interleaved):
    theta, eps = 1e7, 1e-6
    for T, unit_offset, seed in ((1, True, 0), (BLOCK_T + 3, False, 1)):  # a masked block: 11 = 8 + 3
        q, k, wq, wk, positions = layer(T, dims, dtype, seed)
        rot = dims[3]
        got_q, got_k = qk_norm_rope(q, k, wq, wk, positions, rope_inv_freq(rot, theta, q.device), eps, unit_offset,
                                    interleaved=interleaved)
        want_q = model_ops(q, wq, positions, rot, theta, eps, unit_offset, interleaved)
        want_k = model_ops(k, wk, positions, rot, theta, eps, unit_offset, interleaved)
        assert got_q.is_contiguous() and got_q.shape == want_q.shape and got_q.dtype == dtype
        assert rel_err(got_q, want_q) < TOL[dtype] and rel_err(got_k, want_k) < TOL[dtype], (T, unit_offset)
        # the unrotated channels are the normed rows: no rotation leaks past the rotary dim
        assert rel_err(got_q[..., rot:], want_q[..., rot:]) < TOL[dtype]


@in_process
def test_a_wrong_swap_of_the_pairs_would_be_seen():
    """The check above can fail: the other rotation's pairs give another result at these inputs."""
    dims = DIMS[0]
    q, k, wq, wk, positions = layer(5, dims, torch.float32, 7)
    inv = rope_inv_freq(dims[3], 1e7, q.device)
    got_q, _ = qk_norm_rope(q, k, wq, wk, positions, inv, 1e-6, True, interleaved=False)
    other = model_ops(q, wq, positions, dims[3], 1e7, 1e-6, True, interleaved=True)
    assert rel_err(got_q, other) > 0.1


@in_process
def test_bad_shapes_are_one_line_errors():
    q, k, wq, wk, positions = layer(3, DIMS[0], torch.float32, 2)
    inv = rope_inv_freq(8, 1e7, q.device)
    for bad in (dict(k=k[:2]), dict(positions=positions[:2]), dict(q_weight=wq[:4]),
                dict(inv_freq=rope_inv_freq(64, 1e7, q.device)), dict(inv_freq=inv.double())):
        args = dict(q=q, k=k, q_weight=wq, k_weight=wk, positions=positions, inv_freq=inv, eps=1e-6,
                    unit_offset=True) | bad
        assert_one_line_error(lambda: qk_norm_rope(**args), "qk_norm_rope")
