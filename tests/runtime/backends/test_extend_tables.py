"""The captured extend step's tables made on the device (kernels/extend_tables.py) against token_blocks.

For random request lengths, padded request counts and padded token counts, every table
`fill_extend_tables` writes equals what the host path computes (launch_math.token_blocks over the
same lengths and the padding rows as one more request, the empty request's rows after), request
B's slot is the padding slot whatever a larger bucket's step left there, and nothing outside the
spans and that slot is written.
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
from runtime.cache.state_pool import PADDING_SLOT  # noqa: E402

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
    with_padding = np.append(full, T - real)  # request B+1: the padding rows
    for rows, size in ((cdiv(T, CHUNK) + B, CHUNK), (cdiv(T, CONV) + B + 1, CONV)):
        blocks = token_blocks(with_padding, size)
        t = np.tile(np.array([B, 0], dtype=np.int64), (rows, 1))
        t[:blocks.shape[0]] = blocks
        tables.append(t)
    return [bounds, *tables]


@in_process
@pytest.mark.parametrize("lens,T,B", [
    ([32], 32, 1), ([1], 16, 1), ([16], 16, 16), ([64, 1, 65], 256, 4), ([100, 3, 0][:2], 128, 8),
    ([7] * 5, 64, 64), ([300, 500, 1, 129], 1024, 256), ([], 16, 1),
    ([1, 1], 128, 2), ([1] * 16, 16, 16), ([65], 4096, 1),  # the chunk table full to its last row
    ([3] * 70 + [1, 40] * 15, 1024, 128),  # requests in several of the kernel's groups of REQUESTS
])
def test_tables_match_the_host_path(lens, T, B):
    real = sum(lens)
    qsl = np.full(B + 1, real, dtype=np.int32)
    qsl[:len(lens) + 1] = np.concatenate([[0], np.cumsum(lens)]) if lens else [0]
    spans, size = layout(T, B)
    out = torch.full((size + 8,), -7, dtype=torch.int64, device=DEVICE)
    slots = torch.arange(B + 3, dtype=torch.int64, device=DEVICE) + 100  # the step's ids, then a larger step's
    fill_extend_tables(torch.from_numpy(qsl).to(DEVICE), out, slots, T, B, spans, CHUNK, CONV)
    got = out.cpu().numpy()
    for (at, shape), want in zip(spans, expected(lens, T, B)):
        np.testing.assert_array_equal(got[at:at + int(np.prod(shape))].reshape(shape), want)
    assert (got[size:] == -7).all(), "written past the tables"
    want_slots = list(range(100, 100 + B)) + [PADDING_SLOT, 100 + B + 1, 100 + B + 2]
    assert slots.tolist() == want_slots, "request B's slot is the padding slot, no other slot is written"


@in_process
def test_refuses_offsets_or_slots_of_the_wrong_shape():
    spans, size = layout(32, 2)
    out, slots = torch.zeros(size, dtype=torch.int64, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        fill_extend_tables(torch.zeros(4, dtype=torch.int32, device=DEVICE), out, slots, 32, 2, spans, CHUNK, CONV)
    with pytest.raises(ValueError, match="slots must be int64 with room for 3 requests"):
        fill_extend_tables(torch.zeros(3, dtype=torch.int32, device=DEVICE), out, slots[:2], 32, 2, spans, CHUNK,
                           CONV)


@in_process
def test_one_kernel_variant_for_every_request_count(monkeypatch):
    """The launch's compile-time constants are the same for 1 and 256 requests: a bundle built for
    one count of extend requests holds the kernel a runtime of another count launches."""
    from runtime.backends.kernels import extend_tables

    kernel, seen = extend_tables._extend_tables_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                seen.append(constexprs)
                return kernel[grid](*args, **constexprs)
            return launch

    monkeypatch.setattr(extend_tables, "_extend_tables_kernel", Recorder())
    for T, B in ((32, 1), (1024, 256)):
        spans, size = layout(T, B)
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=DEVICE)
        qsl[1:] = torch.arange(1, B + 1, dtype=torch.int32) if T >= B else 0
        out = torch.zeros(size, dtype=torch.int64, device=DEVICE)
        slots = torch.zeros(B + 1, dtype=torch.int64, device=DEVICE)
        fill_extend_tables(qsl, out, slots, T, B, spans, CHUNK, CONV)
    assert len(seen) == 2 and seen[0] == seen[1]
