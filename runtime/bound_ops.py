"""BoundOps: an op table whose entries call a backend with the current step's ExecContext.

The runtime makes one per model instance. `with ops.step(ctx): model(...)` runs a step: every
`ops.gdn_core(...)` call (eager model) or bound op node (loaded graph) becomes
`backend.gdn_core(ctx, ...)`. Outside a step, calling an op is an error rather than a silent
use of stale metadata.
"""

from __future__ import annotations

import contextlib

from compiler.splitops import OP_SPECS, op_spec
from runtime.context import ExecContext

__all__ = ["BoundOps", "NoStepError"]


class NoStepError(RuntimeError):
    pass


class BoundOps:
    def __init__(self, backend):
        missing = [name for name in OP_SPECS if not callable(getattr(backend, name, None))]
        if missing:
            raise TypeError(f"backend {type(backend).__name__} does not implement ops {missing}")
        self.backend = backend
        self.ctx: ExecContext | None = None
        # Called as observer(op name, args) after each op: the graph runner's start-up parity
        # check records each layer's output with it. None (one attribute test) when unused.
        self.observer = None
        # Called as intercept(op name, method, ctx, args) instead of the backend's method: the
        # parity check runs each op of an unpadded step on a padded step's inputs with it
        # (runtime/parity.py TeacherForcing). None (one attribute test) when unused.
        self.intercept = None

    @contextlib.contextmanager
    def step(self, ctx: ExecContext):
        if self.ctx is not None:
            raise RuntimeError("BoundOps.step: a step is already running on this op table")
        self.ctx = ctx
        try:
            yield self
        finally:
            self.ctx = None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        op_spec(name)
        method = getattr(self.backend, name)

        def call(*args):
            if self.ctx is None:
                raise NoStepError(f"hgc.{name} called outside a runtime step (use `with ops.step(ctx):`)")
            if self.intercept is None:
                method(self.ctx, *args)
            else:
                self.intercept(name, method, self.ctx, args)
            if self.observer is not None:
                self.observer(name, args)

        call.__name__ = name
        # Cache it: __getattr__ runs only for missing attributes, so every later `ops.<name>` of an
        # eager model's step finds the bound call directly instead of building it again.
        self.__dict__[name] = call
        return call
