"""What a pass is: a small class with a `name`, `__call__(gm, ctx) -> PassResult`, and its conditions.

A pass works on one program's GraphModule (the pass manager hands it each program in turn: the
main model, then the draft where there is one) and on the CompileContext every pass shares. It
records what it derives in `node.meta["hgc.<key>"]` and in the context; it never opens a file or
prints (instruments do that).

1. `requires(gm, ctx)` (optional): raise `PreconditionError` when an earlier pass has not run or
   has left the graph unfit; the message names that pass.
2. `__call__(gm, ctx)`: do the work, return `PassResult(graph_module, modified, stop=False)`.
   `stop=True` ends the pipeline after this pass has run on every program (a lint pass that
   found errors stops the compile before passes that cannot work on a broken graph).
3. `ensures(gm, ctx)` (optional): raise `PostconditionError` when the pass did not leave what it
   promises.
4. `fingerprint()`: name, version and config, recorded in manifest.json. Bump `version` when a
   pass changes what it produces; the source hash catches edits that forget to.

Errors a user can act on are `CompileError`s whose message names pass, node, layer and a fix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Optional

import torch.fx

from compiler.splitops.errors import CompileError

__all__ = ["PassResult", "CompilePass", "CompileError", "PassError", "PreconditionError", "PostconditionError",
           "class_source"]


@functools.cache
def class_source(cls: type) -> str:
    """A class's source, which a pass's fingerprint digests. Read once a process: inspect finds a
    class's source by parsing its whole module, and every compile fingerprints every pass."""
    return inspect.getsource(cls)


class PreconditionError(CompileError):
    pass


class PostconditionError(CompileError):
    pass


class PassError(CompileError):
    """A pass failed; raised by the manager with the passes that ran before it."""

    def __init__(self, pass_name: str, program: str, ran: list[str], cause: BaseException):
        self.pass_name, self.program, self.ran, self.cause = pass_name, program, list(ran), cause
        before = ", ".join(ran) if ran else "none"
        what = str(cause) if isinstance(cause, CompileError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"pass {pass_name} failed on program {program} (passes run before: {before}): {what}")


@dataclasses.dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool = False
    stop: bool = False  # end the pipeline after this pass (it found errors later passes cannot survive)
    report: Optional[dict] = None  # what the pass did, where it says more than `modified` (the fusion pass's)


class CompilePass:
    """Base of every pass; subclasses set `name` (and `version`) and implement `__call__`."""

    name: str = ""
    version: int = 1

    def requires(self, gm: torch.fx.GraphModule, ctx) -> None:
        """Preconditions: nothing by default."""

    def ensures(self, gm: torch.fx.GraphModule, ctx) -> None:
        """Postconditions: nothing by default."""

    def __call__(self, gm: torch.fx.GraphModule, ctx) -> PassResult:  # pragma: no cover
        raise NotImplementedError(f"pass {self.name} has no __call__")

    def config(self) -> dict:
        """The settings that change what this pass produces (part of its fingerprint)."""
        return {}

    def fingerprint(self) -> dict:
        return {"name": self.name, "version": self.version, "config": self.config(),
                "source_sha256": hashlib.sha256(class_source(type(self)).encode()).hexdigest()}
