"""The q / k norm and partial rotary kernel (runtime/backends/kernels/norm_rope.py) against the model's ops.

On a machine without CUDA the kernel runs in Triton's interpreter: CPU tests of its logic (the
pairs of NeoX and GPT-J rotations, the unrotated channels, unit-offset and plain scales, q's heads
read through the projection's strided view beside its gates, k's heads after them, masked token
blocks), not of speed. The oracle is models/common.py: `RMSNorm` then `apply_rotary`, what the
traced glue runs, on fresh random inputs each check, compared by ||out - ref|| / ||ref|| (16-bit
outputs: the interpreter truncates where a GPU rounds to nearest, so a value may differ by one unit).
The compiled kernel's cos and sin (a reduction by 2 pi in three parts, then the hardware's
approximations) have no interpreter form: the reduction is checked here in float32 arithmetic,
the kernel at bench dims on a GPU (tests/gpu/test_gpu_norm_rope.py).
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

import math  # noqa: E402

import numpy as np  # noqa: E402

from models.common import RMSNorm, apply_rotary, rope_inv_freq  # noqa: E402
from runtime.backends.kernels import norm_rope as NR  # noqa: E402
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


def test_the_compiled_angle_reduction_keeps_cos_and_sin_within_4e_6():
    """`_cos_sin`'s FAST_TRIG reduction, step for step in float32 (each fma one rounding): the three
    parts of 2 pi sum to it, the first has 8 significant bits (so k times it is exact for the k of
    positions up to 262144), and the reduced angle's cos and sin are within 4e-6 of the float32
    angle's own at every position and frequency of qwen3_next's rotary (64 of 256, theta 1e7) and a
    theta of 1e4, each reduced angle within 0.05 of [-pi, pi] (k is taken from the angle times
    1 / (2 pi) in float32, which may round it one way or the other at large angles), where the
    hardware's approximations keep their accuracy."""
    hi, mid, lo, inv = (float(c.value) for c in (NR.TWO_PI_HI, NR.TWO_PI_MID, NR.TWO_PI_LO, NR.INV_TWO_PI))
    assert abs(hi + mid + lo - 2 * math.pi) < 1e-15 and (hi * 32).is_integer() and hi * 32 < 256
    assert np.float32(mid) == mid and np.float32(lo) == lo

    def fma(a, b, c):  # a * b + c rounded once to float32 (the product of two float32 is exact in float64)
        return (a.astype(np.float64) * b + c.astype(np.float64)).astype(np.float32)

    positions = np.arange(0, 262144, 7, dtype=np.float32)
    for theta in (1e7, 1e4):
        angle = positions[:, None] * rope_inv_freq(64, theta).numpy()[None, :]  # float32, as the kernel
        k = np.rint(angle * np.float32(inv)).astype(np.float32)
        r = fma(-k, np.float32(hi), angle)
        r = fma(-k, np.float32(mid), r)
        r = fma(-k, np.float32(lo), r)
        assert np.abs(r).max() <= math.pi + 0.05
        exact = angle.astype(np.float64)
        assert np.abs(np.cos(r.astype(np.float64)) - np.cos(exact)).max() < 4e-6, theta
        assert np.abs(np.sin(r.astype(np.float64)) - np.sin(exact)).max() < 4e-6, theta
