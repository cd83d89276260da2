"""Instruments: objects the pass manager calls around every pass. Dumps and timing live here, not in passes.

Hooks, in the order the manager calls them (see manager.py):

    run_before_pipeline(ctx)
    run_before_pass(pass_, index, gm, ctx)      for each pass, for each program
    run_after_pass(pass_, index, result, ctx)
    run_after_pipeline(ctx)                     also after a failure

- `TimingInstrument` measures each pass on each program and prints one table at the end.
- `ProgressInstrument` advances a progress bar (a tqdm-like factory handed in by the command
  line) by one for each pass on each program.
- `DumpInstrument` writes the graph of each program after each pass: `dumps/NN_<pass>.txt` (readable
  graph), `.onnx` (opens in Netron; hgc op nodes carry layer id and op name), and once per pass
  `dumps/NN_<pass>.svg`, the layer picture of every program side by side (compiler/dump/layers.py).
  The main program's files sit in `dumps/`, the draft's in `dumps/draft/`. NN is the pass's
  position in the pipeline; 00 is the exported graph before any pass.

Instruments may write files and print; passes never do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from tabulate import tabulate

__all__ = ["Instrument", "TimingInstrument", "DumpInstrument", "ProgressInstrument"]


class Instrument:
    """No-op hooks; subclasses override the ones they need."""

    def run_before_pipeline(self, ctx) -> None:
        pass

    def run_before_pass(self, pass_, index: int, gm, ctx) -> None:
        pass

    def run_after_pass(self, pass_, index: int, result, ctx) -> None:
        pass

    def run_after_pipeline(self, ctx) -> None:
        pass


class TimingInstrument(Instrument):
    """Wall time of each pass on each program; `extra` lets the pipeline add its own stages (export, write)."""

    def __init__(self, stream: TextIO | None = None, title: str = "hgc compile"):
        self.stream = stream
        self.title = title
        self.rows: list[tuple[str, str, float]] = []  # (stage, program, seconds)
        self._start = 0.0

    def add(self, stage: str, program: str, seconds: float) -> None:
        self.rows.append((stage, program, seconds))

    def run_before_pass(self, pass_, index, gm, ctx) -> None:
        self._start = time.perf_counter()

    def run_after_pass(self, pass_, index, result, ctx) -> None:
        self.rows.append((f"{index:02d} {pass_.name}", ctx.program, time.perf_counter() - self._start))

    def table(self) -> str:
        rows = [(stage, program, f"{seconds * 1000:.1f}") for stage, program, seconds in self.rows]
        rows.append(("total", "", f"{sum(s for _, _, s in self.rows) * 1000:.1f}"))
        return tabulate(rows, headers=("stage", "program", "ms"), tablefmt="simple")

    def print_table(self) -> None:
        stream = self.stream or sys.stderr
        print(f"{self.title}: timings", file=stream)
        print(self.table(), file=stream, flush=True)


class ProgressInstrument(Instrument):
    """One bar over the pipeline: a step per pass and program, the pass's name as its label."""

    def __init__(self, progress, num_passes: int):
        self.progress = progress
        self.num_passes = num_passes
        self.bar = None

    def run_before_pipeline(self, ctx) -> None:
        self.bar = self.progress(total=self.num_passes * len(ctx.program_names), desc="passes", unit="pass")

    def run_before_pass(self, pass_, index, gm, ctx) -> None:
        self.bar.set_description(f"pass {pass_.name} ({ctx.program})")

    def run_after_pass(self, pass_, index, result, ctx) -> None:
        self.bar.update()

    def run_after_pipeline(self, ctx) -> None:
        if self.bar is not None:
            self.bar.close()


class DumpInstrument(Instrument):
    """Writes text and ONNX of every program, and the layer picture of all of them, before the
    pipeline (00_export) and after each pass.

    With a TimingInstrument, the time spent writing dumps is reported as its own row.
    """

    def __init__(self, folder: str | Path, formats: tuple[str, ...] = ("txt", "onnx", "svg"),
                 timing: "TimingInstrument | None" = None):
        self.folder = Path(folder)
        self.formats = formats
        self.timing = timing
        self.written: list[Path] = []
        self.seconds = 0.0

    def _base(self, index: int, name: str, program: str) -> Path:
        folder = self.folder if program == "main" else self.folder / program
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{index:02d}_{name}"

    def _write(self, index: int, name: str, gm, ctx) -> None:
        from compiler.dump import write_dumps, write_layer_picture

        start = time.perf_counter()
        self.written.extend(write_dumps(self._base(index, name, ctx.program), gm, ctx, title=name,
                                        formats=self.formats))
        # once every program is through this pass: the picture shows them side by side
        if "svg" in self.formats and ctx.program == ctx.program_names[-1]:
            self.written.append(write_layer_picture(self._base(index, name, "main").with_suffix(".svg"), ctx, name))
        self.seconds += time.perf_counter() - start

    def run_before_pipeline(self, ctx) -> None:
        for program in ctx.program_names:
            ctx.program = program
            self._write(0, "export", ctx.programs[program], ctx)

    def run_after_pass(self, pass_, index, result, ctx) -> None:
        self._write(index, pass_.name, result.graph_module, ctx)

    def run_after_pipeline(self, ctx) -> None:
        if self.timing is not None:
            self.timing.add("dumps", "", self.seconds)
