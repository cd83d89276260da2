"""PassManager: runs the ordered pass list over every program, with instruments around each pass.

The order is decided in one place, `compiler/pipeline.py`; the manager only executes it:

1. `run_before_pipeline` on every instrument (the dump instrument writes the exported graph, 00).
2. For each pass, in list order, for each program (main first, then draft):
   a. `pass.requires(gm, ctx)`;
   b. `run_before_pass` on every instrument;
   c. `pass(gm, ctx)` -> PassResult; the program's graph is replaced by `result.graph_module`;
   d. `pass.ensures(gm, ctx)`;
   e. `run_after_pass` on every instrument (dumps NN_<pass>.*, records time).
   A pass runs on every program before the next pass starts, so a pass that compares programs
   (the artifact-scope lints) sees all of them in the same state.
3. If a pass returned `stop=True` on any program, the pipeline ends after it (`ctx.stopped_after`).
4. `run_after_pipeline` on every instrument, also after a failure (the timing table still prints).

Any exception from a pass or its conditions is re-raised as `PassError`, naming the pass, the
program and every pass that ran before it.

What it does not do: choose or reorder passes, catch lint findings (they are data in ctx).
"""

from __future__ import annotations

from typing import Sequence

from compiler.passes.base import CompilePass, PassError, PassResult

__all__ = ["PassManager"]


class PassManager:
    def __init__(self, passes: Sequence[CompilePass], instruments: Sequence = ()):
        names = [p.name for p in passes]
        dup = sorted({n for n in names if names.count(n) > 1})
        assert not dup, f"pass names must be unique (dumps and fingerprints use them): {dup}"
        assert all(names), "every pass needs a name"
        self.passes = list(passes)
        self.instruments = list(instruments)

    def fingerprints(self) -> list[dict]:
        return [p.fingerprint() for p in self.passes]

    def run(self, ctx) -> None:
        ran: list[str] = []
        for inst in self.instruments:
            inst.run_before_pipeline(ctx)
        try:
            for index, p in enumerate(self.passes, start=1):
                stop = False
                for program in ctx.program_names:
                    ctx.program = program
                    gm = ctx.programs[program]
                    try:
                        p.requires(gm, ctx)
                        for inst in self.instruments:
                            inst.run_before_pass(p, index, gm, ctx)
                        result = p(gm, ctx)
                        if not isinstance(result, PassResult):
                            raise TypeError(f"pass {p.name} returned {type(result).__name__}, not a PassResult")
                        ctx.programs[program] = result.graph_module
                        p.ensures(result.graph_module, ctx)
                    except Exception as e:
                        raise PassError(p.name, program, ran, e) from e
                    for inst in self.instruments:
                        inst.run_after_pass(p, index, result, ctx)
                    stop = stop or result.stop
                ran.append(p.name)
                if stop:
                    ctx.stopped_after = p.name
                    break
        finally:
            ctx.program = ctx.program_names[0] if ctx.program_names else "main"
            for inst in self.instruments:
                inst.run_after_pipeline(ctx)
