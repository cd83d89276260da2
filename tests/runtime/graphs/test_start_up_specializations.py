"""A run's start-up launches no Triton kernel build that the build's start-up did not.

`hgc build` starts the engine once under its own limits (every recorded bucket, no prefix cache)
and copies the kernels it built into the bundle; a run starts under the user's (`hgc run` of short
prompts: 3 slots, max_seq_len 15, the prefix cache on) and refuses to build a kernel the bundle
lacks. Triton builds a kernel per constexpr value and per specialization of the other arguments: a
pointer 16-byte aligned or not, an integer equal to 1, divisible by 16 or neither. Here, on the CPU
(the linear layers on triton_linear in Triton's interpreter, graphs re-run eagerly), both start-ups
record that signature of every launch, and the run's must all be among the build's (the fused GDN
mixer's launches, as a cuda bundle routes GDN layers). (The GPU test
of the same promise, with real builds, is tests/gpu/test_gpu_inductor.py.)"""

from __future__ import annotations

import pytest
import torch

from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from testkit.graph_cases import RerunGraphs
from testkit.helpers import tiny_checkpoint
from testkit.linear_cases import compile_linear_routed, interpreted_linear_registry

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

from testkit.triton_interpreter import INTERPRETED  # noqa: E402

if not INTERPRETED:
    pytest.skip("the signatures are read off the interpreter's launches", allow_module_level=True)


@pytest.fixture(scope="module")
def registry():
    return interpreted_linear_registry("tests/runtime/graphs/test_start_up_specializations.py")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, registry):
    # One GDN layer and one full-attention layer: every GDN layer launches the same kernels with
    # arguments of the same kinds, and tiny's three made the interpreter walk each extend's chunk
    # kernels three times (most of the module's time). Few buckets (the interpreter walks every
    # program of a launch), one with a one-request key; chunk_impl=triton: the kernels that write
    # in-step snapshots. The fused mixer, as a cuda bundle routes it by default: its own kernels (the
    # split decode, the gates, the gated norm) and, in extend steps, the extend conv and chunk kernels
    # the unfused ops launch.
    root = tmp_path_factory.mktemp("specializations")
    ckpt = tiny_checkpoint("qwen3_next", root / "ckpt", seed=0, num_hidden_layers=2, full_attention_interval=2)
    compile_linear_routed(ckpt, root / "art", ("gdn_fused",), "chunk_impl=triton", registry,
                          decode_batch_sizes=(1, 2, 4), extend_token_counts=(16, 64))
    return load_artifact(root / "art")


def _spec(value):
    """What Triton specializes a non-constexpr argument on."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return ("value", repr(value)) if isinstance(value, (bool, str)) else ("other", type(value).__name__)
    return ("int", value == 1, value % 16 == 0)


def launches_of(start_up, monkeypatch) -> set:
    """The (kernel, argument signatures) of every Triton launch during start_up()."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set = set()
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        # keyword arguments are our launches' constexprs and launch options: their values count whole
        seen.add((self.fn.__name__, tuple(_spec(a) for a in args),
                  tuple(sorted((k, repr(v)) for k, v in kwargs.items()))))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    start_up()
    monkeypatch.setattr(InterpretedFunction, "run", real)
    return seen


def test_a_short_prompt_run_launches_only_what_the_build_launched(artifact, registry, monkeypatch):
    buckets = artifact.manifest["buckets"]
    # as hgc build starts it: the largest buckets' limits, no prefix cache
    build_options = EngineOptions(slots=max(buckets["decode_batch_sizes"]), page_size=16, prefix_cache=False,
                                  token_budget=max(buckets["extend_token_counts"]))
    build = launches_of(lambda: engine_for_artifact(artifact, build_options, 512, registry=registry,
                                                    graphs=RerunGraphs()), monkeypatch)
    # as hgc run of three short prompts starts it
    run_options = EngineOptions(slots=3, token_budget=512, page_size=16, prefix_cache=True, prefix_snapshots=8)
    run = launches_of(lambda: engine_for_artifact(artifact, run_options, 15, registry=registry,
                                                  graphs=RerunGraphs()), monkeypatch)
    assert build and run
    extra = sorted(run - build)
    # (before the staging block aligned its tables: _chunk_state_kernel and _short_conv_extend_kernel with
    # the snapshot ids of a one-request key at an 8-byte offset, the two kernels a GPU run built)
    assert not extra, f"{len(extra)} launch signatures the build never ran, e.g. {extra[:2]}"
