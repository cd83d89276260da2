"""models/common.py `apply_rotary`: the NeoX (rotate_half) and interleaved rotations against a float64
rotation of channel pairs, and what Inductor keeps of the NeoX form when it compiles it."""

from __future__ import annotations

import re

import pytest
import torch

from models.common import apply_rotary, rope_inv_freq

T, H, D, R, THETA = 9, 3, 32, 16, 10000.0


def rotated_reference(x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Each pair of the first R channels turned by position * inv_freq, in float64; the rest as they are."""
    angle = positions.double()[:, None] * rope_inv_freq(R, THETA, x.device).double()  # [T, R/2]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    rot = x[..., :R].double()
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., : R // 2], rot[..., R // 2:])
    a, b = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)
    return torch.cat((out, x[..., R:].double()), -1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_the_pairwise_reference(interleaved, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, D, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 5, 3, 65535])
    got = apply_rotary(x, positions, R, THETA, interleaved=interleaved)
    want = rotated_reference(x, positions, interleaved)
    assert got.dtype == dtype and torch.equal(got[..., R:], x[..., R:]), "the channels past R pass through"
    tol = 1e-4 if dtype == torch.float32 else 8e-3  # the angle is taken in float32, as the model does
    assert float((got.double() - want).norm() / want.norm()) < tol


def test_the_neox_form_is_the_nested_cat_bit_for_bit():
    """Each half cast on its own gives the bits of the rotated channels cast together."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    positions = torch.arange(T) * 37
    freqs = positions.float()[:, None] * rope_inv_freq(R, THETA, x.device)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = x[..., : R // 2].float(), x[..., R // 2:R].float()
    nested = torch.cat((torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype), x[..., R:]), -1)
    assert torch.equal(apply_rotary(x, positions, R, THETA), nested)


def test_inductor_keeps_no_float32_buffer_of_the_rotated_channels():
    """Compiled (CPU, C++), the NeoX rotation writes its output from its inputs in one pass: no
    float32 buffer of the R rotated channels between them (the nested cat had one)."""
    from torch._inductor.utils import run_and_get_code
    x = torch.randn(T, H, D).to(torch.bfloat16)
    positions = torch.arange(T)
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(lambda a, p: apply_rotary(a, p, R, THETA)), x, positions)
    assert torch.equal(out, apply_rotary(x, positions, R, THETA))
    buffers = re.findall(r"buf\d+ = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code)
    assert buffers, code
    assert not [shape for shape, dtype in buffers if dtype == "float32" and shape.split(",")[-1].strip() in
                (str(R), str(R // 2))], buffers
