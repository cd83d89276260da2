"""runtime/backends/kernels/launch_cache.py: a repeated argument list launches the kernel Triton compiled
for it, with every parameter in order; anything else goes through Triton's path.

A stand-in for a JIT function and its compiled kernel records what each path was given (a real
compiled kernel needs a GPU: tests/gpu/test_gpu_linear_kernels.py checks the outputs there)."""

import inspect
import types

import pytest
import torch

from runtime.backends.kernels.launch_cache import Launcher


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        self.launches.append(((gx, gy, gz), stream, args))


class FakeKernel:
    """fn[grid](*args, **kwargs) -> a compiled kernel; `params` as Triton's JITFunction has them."""

    def __init__(self, compiles=True):
        def kernel(x, n, y, BLOCK, MODE=3):
            pass

        self.params = [types.SimpleNamespace(name=p.name, default=p.default)
                       for p in inspect.signature(kernel).parameters.values()]
        self.compiles, self.slow_launches, self.compiled = compiles, [], FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_launches.append((grid, args, kwargs))
            return self.compiled if self.compiles else None
        return launch


class StreamLauncher(Launcher):
    device = 0

    def _device(self):
        return self.device

    @staticmethod
    def _stream(device):
        return f"stream of {device}"


def test_the_same_arguments_launch_the_compiled_kernel_with_every_parameter():
    kernel = FakeKernel()
    launch = StreamLauncher(kernel)
    x, y = torch.zeros(4), torch.zeros(4)
    launch[(2, 3)](x, 7, y, BLOCK=16, num_warps=4)
    assert len(kernel.slow_launches) == 1 and launch.misses == 1
    x2 = x.view(4)  # another tensor object at the same address, same dtype: the same arguments
    launch[(2, 3)](x2, 7, y, BLOCK=16, num_warps=4)
    assert launch.hits == 1 and len(kernel.slow_launches) == 1
    (grid, stream, args), = kernel.compiled.launches
    # the constexprs after the positional arguments, from the keywords or their defaults
    assert grid == (2, 3, 1) and stream == "stream of 0" and args[1:] == (7, y, 16, 3) and args[0] is x2


@pytest.mark.parametrize("change", ["address", "dtype", "int", "constexpr", "option", "grid"])
def test_any_other_argument_list_goes_through_triton(change):
    kernel = FakeKernel()
    launch = StreamLauncher(kernel)
    base = torch.zeros(8)
    x, y = base[:4], torch.zeros(4)
    call = dict(grid=(2,), args=(x, 7, y), kwargs=dict(BLOCK=16, num_warps=4))
    launch[call["grid"]](*call["args"], **call["kwargs"])
    other = {"address": dict(args=(base[1:5], 7, y)), "dtype": dict(args=(x.view(torch.int32), 7, y)),
             "int": dict(args=(x, 8, y)), "constexpr": dict(kwargs=dict(BLOCK=32, num_warps=4)),
             "option": dict(kwargs=dict(BLOCK=16, num_warps=8)), "grid": dict(grid=(3,))}[change]
    call.update(other)
    launch[call["grid"]](*call["args"], **call["kwargs"])
    assert launch.misses == 2 and launch.hits == 0 and len(kernel.slow_launches) == 2
    assert kernel.compiled.launches == []


def test_an_interpreted_kernel_always_takes_tritons_path():
    kernel = FakeKernel(compiles=False)  # TRITON_INTERPRET: the launch returns no compiled kernel
    launch = StreamLauncher(kernel)
    x = torch.zeros(4)
    for _ in range(3):
        launch[(1,)](x, 1, x, BLOCK=16)
    assert launch.hits == 0 and len(kernel.slow_launches) == 3


def test_the_oldest_argument_lists_are_forgotten_first():
    kernel = FakeKernel()
    launch = StreamLauncher(kernel, size=2)
    x = torch.zeros(4)
    for n in (1, 2, 3):
        launch[(1,)](x, n, x, BLOCK=16)
    launch[(1,)](x, 3, x, BLOCK=16)
    launch[(1,)](x, 1, x, BLOCK=16)  # forgotten: the size is 2
    assert launch.hits == 1 and launch.misses == 4


def test_a_disabled_launcher_takes_tritons_path_every_time(monkeypatch):
    kernel = FakeKernel()
    launch = StreamLauncher(kernel)
    monkeypatch.setattr(Launcher, "enabled", False)
    x = torch.zeros(4)
    for _ in range(2):
        launch[(1,)](x, 1, x, BLOCK=16)
    assert launch.hits == launch.misses == 0 and len(kernel.slow_launches) == 2


def test_the_same_arguments_on_another_device_go_through_triton():
    kernel = FakeKernel()
    launch = StreamLauncher(kernel)
    x = torch.zeros(4)
    launch[(1,)](x, 1, x, BLOCK=16)
    launch.device = 1  # the same addresses, another current device: Triton's cache is per device
    launch[(1,)](x, 1, x, BLOCK=16)
    assert launch.hits == 0 and launch.misses == 2
    launch[(1,)](x, 1, x, BLOCK=16)
    (_, stream, _), = kernel.compiled.launches
    assert launch.hits == 1 and stream == "stream of 1"


def test_totals_sum_every_launchers_hits_and_misses():
    """Launcher.totals: what a benchmark differences around a step to count the launches that took
    Triton's path (step_account.py --timeline)."""
    hits0, misses0 = Launcher.totals()
    first, second = StreamLauncher(FakeKernel()), StreamLauncher(FakeKernel())
    x = torch.zeros(4)
    for _ in range(3):
        first[(1,)](x, 1, x, BLOCK=16)
    second[(1,)](x, 2, x, BLOCK=16)
    assert (first.hits, first.misses, second.hits, second.misses) == (2, 1, 0, 1)
    assert Launcher.totals() == (hits0 + 2, misses0 + 2)
