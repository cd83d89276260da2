"""The captured extend step's tables made on the device (kernels/extend_tables.py) against token_blocks.

For random request lengths, padded request counts and padded token counts, every table
`fill_extend_tables` writes equals what the host path computes (launch_math.token_blocks over the
same lengths, the empty request's rows after), and nothing outside the spans is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels.extend_tables import fill_extend_tables  # noqa: E402
from runtime.backends.kernels.launch_math import cdiv, token_blocks  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

CHUNK, CONV = 64, 32


def layout(T: int, B: int):
    """The backend's spans for a bucket, and the buffer size they need."""
    from runtime.backends.triton_linear import _StaticExtendPlan
    return _StaticExtendPlan._layout(T, B), _StaticExtendPlan._size(T, B)


def expected(lens: list[int], T: int, B: int):
    real = sum(lens)
    full = np.zeros(B + 1, dtype=np.int64)
    full[:len(lens)] = lens
    bounds = np.zeros(B + 3, dtype=np.int64)
    np.cumsum(full, out=bounds[1:B + 2])
    bounds[B + 2] = T
    tables = []
    for rows, blocks in ((cdiv(T, CHUNK) + B, token_blocks(full, CHUNK)),
                         (cdiv(T, CONV) + B + 1, token_blocks(np.append(full, T - real), CONV))):
        t = np.tile(np.array([B, 0], dtype=np.int64), (rows, 1))
        t[:blocks.shape[0]] = blocks
        tables.append(t)
    return [bounds[:B + 2], bounds, *tables]


@in_process
@pytest.mark.parametrize("lens,T,B", [
    ([32], 32, 1), ([1], 16, 1), ([16], 16, 16), ([64, 1, 65], 256, 4), ([100, 3, 0][:2], 128, 8),
    ([7] * 5, 64, 64), ([300, 500, 1, 129], 1024, 256), ([], 16, 1),
])
def test_tables_match_the_host_path(lens, T, B):
    real = sum(lens)
    qsl = np.full(B + 1, real, dtype=np.int32)
    qsl[:len(lens) + 1] = np.concatenate([[0], np.cumsum(lens)]) if lens else [0]
    spans, size = layout(T, B)
    out = torch.full((size + 8,), -7, dtype=torch.int64, device=DEVICE)
    fill_extend_tables(torch.from_numpy(qsl).to(DEVICE), out, T, B, spans, CHUNK, CONV)
    got = out.cpu().numpy()
    for (at, shape), want in zip(spans, expected(lens, T, B)):
        np.testing.assert_array_equal(got[at:at + int(np.prod(shape))].reshape(shape), want)
    assert (got[size:] == -7).all(), "written past the tables"


@in_process
def test_refuses_offsets_of_the_wrong_shape():
    spans, size = layout(32, 2)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        fill_extend_tables(torch.zeros(4, dtype=torch.int32, device=DEVICE), torch.zeros(size, dtype=torch.int64,
                           device=DEVICE), 32, 2, spans, CHUNK, CONV)
