"""The last-to-arrive counters (runtime/backends/kernels/arrivals.py): one zeroed buffer per user and
device, grown only outside a CUDA graph capture (a growth inside one is refused naming the user),
a grown-out buffer kept referenced, an unknown user refused. The kernels that count on them are
tested with their users (test_triton_moe.py, test_norm_linear.py, test_triton_gdn_fused.py)."""

from __future__ import annotations

import pytest
import torch

from runtime.backends.kernels import arrivals


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(arrivals, "_COUNTERS", {})
    monkeypatch.setattr(arrivals, "_RETIRED", [])
    return arrivals


def test_each_user_has_zeroed_counters_of_its_own(fresh):
    router = fresh.arrival_counters("cpu", 1, "moe router")
    norm = fresh.arrival_counters("cpu", 1, "gemv_add_rms_norm")
    assert router.dtype == torch.int32 and not router.any() and router.numel() >= 1
    assert router.data_ptr() != norm.data_ptr(), "two users never share a counter"
    assert fresh.arrival_counters("cpu", 1, "moe router") is router, "a user's launches share its buffer"


def test_counters_grow_outside_a_capture_and_the_old_ones_stay_referenced(fresh, monkeypatch):
    first = fresh.arrival_counters("cpu", 16, "gdn_fused split")
    grown = fresh.arrival_counters("cpu", first.numel() + 1, "gdn_fused split")
    assert grown.numel() > first.numel() and not grown.any()
    assert fresh._RETIRED == [first], "a graph captured over it replays into memory nothing else was handed"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    meta = torch.device("meta")  # a device whose type the check is asked for without a GPU
    monkeypatch.setattr(fresh, "_COUNTERS", {(torch.device("cuda"), "moe router"): torch.zeros(4, dtype=torch.int32,
                                                                                                device=meta)})
    assert fresh.arrival_counters("cuda", 4, "moe router").numel() == 4, "no growth: fine under capture"
    with pytest.raises(RuntimeError, match=r"moe router: its arrival counters on cuda hold 4; this launch needs 8"):
        fresh.arrival_counters("cuda", 8, "moe router")


def test_an_unknown_user_is_refused(fresh):
    with pytest.raises(ValueError, match="unknown user 'test'"):
        fresh.arrival_counters("cpu", 1, "test")
