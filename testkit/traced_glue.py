"""A program's glue with each segment's own traced glue as its piece (`traced_glue`): what
runtime/artifact/compiled_glue.py installs when a piece is the segment itself rather than an
Inductor build, so tests/compiler/test_glue_in_split_plans.py and benchmarks/host/split_modules_bench.py
run the runtime's real install without compiling a bundle."""

from __future__ import annotations

import torch

from compiler.splitops.artifact import retarget_meta_devices
from compiler.splitops.glue import glue_segments, segment_module
from runtime.artifact.compiled_glue import CompiledGlue


def traced_piece(gm: torch.fx.GraphModule, segment, device: torch.device) -> torch.fx.GraphModule:
    module = segment_module(gm, segment)
    retarget_meta_devices(module.graph, device)
    module.recompile()
    return module


def traced_glue(gm: torch.fx.GraphModule, program: str, device: str = "cpu") -> CompiledGlue:
    """The program's glue with each segment's own traced glue as its piece."""
    segments = glue_segments(gm)
    records = [{**s.to_json(), "piece": f"pieces/{s.index}.bin" if s.outputs else None} for s in segments]
    pieces = {f"pieces/{s.index}.bin": traced_piece(gm, s, torch.device(device)) for s in segments if s.outputs}
    glue = CompiledGlue(program, records, pieces, "traced")
    glue.check(gm)
    return glue


def stand_in_inductor(monkeypatch, count) -> list:
    """compiler/inductor_pieces.compile_piece stood in for (a test of what compile_glue hands Inductor,
    without its C++ or Triton builds): each piece is saved as an empty file, and `count(module)` of
    every segment module it was handed goes into the list returned, in compile order."""
    import compiler.inductor_pieces as inductor_pieces

    compiled: list = []

    class Saved:
        def save(self, path, format):
            open(path, "wb").close()

    def compile_piece(module, device, config_patches=None):
        compiled.append(count(module))
        return Saved()

    monkeypatch.setattr(inductor_pieces, "compile_piece", compile_piece)
    return compiled
