"""BoundOps: the op calls of one model instance, each to a backend, with the current step's ExecContext.

The runtime makes one per model instance; `with ops.step(ctx): model(...)` runs a step. Two ways
an op reaches a backend:

- a loaded graph (runtime/artifact/binding.py): every op node is bound to `ops.call_of(instance, op)`, the
  method of the instance its routing.json entry names; `ops.backend` is then the BackendSet whose
  hooks reach every instance of the program;
- an eager model: `ops.gdn_core(..., layer_id, ...)` calls, when the table was made with `routes`
  (`Backends.op_table`: (op, layer id) -> instance, from routing.json), the instance the layer's
  entry names (for an op a fused node stands for, compiler/splitops/ops.py FUSED_OPS, the instance
  of the layer's fused node); without routes (the `hgc generate` baseline, tests) the one backend
  it was made over.

Every call records (layer id, backend) in `ops.executed` after the backend returned: what ran is
reported from the calls themselves (`hgc run --json`'s executed_backends), not copied from
routing.json. Outside a step, calling an op is an error rather than a silent use of stale metadata.
A step may leave host work to run just before a backend's first op call (`before_first_call`:
the graph runner's plans of the backends whose ops all run in a piecewise step's eager gaps).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

from compiler.splitops import FUSED_OPS, op_arguments, op_spec
from runtime.step.context import ExecContext

__all__ = ["BoundOps", "NoStepError", "backend_name"]


class NoStepError(RuntimeError):
    pass


def backend_name(backend) -> str:
    """The name routing.json uses for `backend`: its declared capability's, else its own."""
    capability = getattr(type(backend), "capability", None)
    return getattr(capability, "name", None) or backend.name


class BoundOps:
    def __init__(self, backend, routes: Mapping[tuple[str, int], object] | None = None):
        self.backend = backend
        self.routes = routes  # (op, layer id) -> backend instance, for an eager model over a routing table
        self.ctx: ExecContext | None = None
        # Called as observer(op name, args) after each op: the graph runner's start-up parity
        # check records each layer's output with it. None (one attribute test) when unused.
        self.observer = None
        # Called as intercept(op name, method, ctx, args) instead of the backend's method: the
        # parity check runs each op of an unpadded step on a padded step's inputs with it
        # (runtime/graphs/parity.py TeacherForcing). None (one attribute test) when unused.
        self.intercept = None
        # (layer id, backend name) of every op call a backend has returned from.
        self.executed: set[tuple[int, str]] = set()
        # backend instance -> host work of the running step to run just before that backend's first
        # op call, once (the graph runner's deferred gap plans: GraphRunner._plan). None (one
        # attribute test) when the step left none, or all have run.
        self.before_first_call: dict[object, Callable[[], None]] | None = None

    @contextlib.contextmanager
    def step(self, ctx: ExecContext):
        if self.ctx is not None:
            raise RuntimeError("BoundOps.step: a step is already running on this op table")
        self.ctx = ctx
        try:
            yield self
        finally:
            self.ctx = None

    def call_of(self, backend, op: str) -> Callable:
        """A callable taking op `op`'s arguments in schema order that runs `backend.<op>(ctx, ...)`."""
        method = getattr(backend, op)
        name = backend_name(backend)
        layer_at = op_arguments(op).index("layer_id")
        executed = self.executed

        def call(*args):
            if self.ctx is None:
                raise NoStepError(f"hgc.{op} called outside a runtime step (use `with ops.step(ctx):`)")
            if self.before_first_call is not None:
                self._first_call_of(backend)
            if self.intercept is None:
                method(self.ctx, *args)
            else:
                self.intercept(op, method, self.ctx, args)
            executed.add((args[layer_at], name))
            if self.observer is not None:
                self.observer(op, args)

        call.__name__ = call.__qualname__ = f"hgc_{op}"
        call.hgc_op, call.hgc_backend = op, backend  # what the start-up check compares with routing.json
        return call

    def _first_call_of(self, backend) -> None:
        """Run what the step left for `backend`'s first op call, if anything."""
        work = self.before_first_call.pop(backend, None)
        if not self.before_first_call:
            self.before_first_call = None
        if work is not None:
            work()

    def sibling(self, backend) -> "BoundOps":
        """An op table of another program of the same model (the draft's) over `backend`, whose
        calls are recorded with this table's: `executed_backends` reports both programs."""
        other = BoundOps(backend)
        other.executed = self.executed
        return other

    def executed_backends(self) -> dict[str, list[str]]:
        """{"<layer id>": [backend, ...]} of every op call so far, layers in order."""
        by_layer: dict[int, set[str]] = {}
        for layer_id, name in self.executed:
            by_layer.setdefault(int(layer_id), set()).add(name)
        return {str(layer_id): sorted(by_layer[layer_id]) for layer_id in sorted(by_layer)}

    def _routed(self, op: str) -> Callable:
        """An eager model's call of `op`: to the instance its layer's routing entry names."""
        calls = {layer: self.call_of(instance, op) for (o, layer), instance in self.routes.items() if o == op}
        # A layer whose region the graph runs as one fused op: the model calls the region's ops,
        # each on the instance routing bound the fused node to.
        for (o, layer), instance in self.routes.items():
            if op in FUSED_OPS.get(o, ()) and layer not in calls:
                calls[layer] = self.call_of(instance, op)
        layer_at = op_arguments(op).index("layer_id")

        def call(*args):
            try:
                target = calls[args[layer_at]]
            except KeyError:
                raise LookupError(f"hgc.{op} of layer {args[layer_at]}: routing.json binds no such node (layers with "
                                  f"hgc.{op}: {sorted(calls)})") from None
            target(*args)

        call.__name__ = op
        return call

    def __getattr__(self, name: str):
        """An eager model's `ops.<op>`: the routed instance of the call's layer, or the one backend."""
        if name.startswith("__"):
            raise AttributeError(name)
        op_spec(name)
        call = self._routed(name) if self.routes is not None else self.call_of(self.backend, name)
        # Cache it: __getattr__ runs only for missing attributes, so every later `ops.<name>` of an
        # eager model's step finds the bound call directly instead of building it again.
        self.__dict__[name] = call
        return call
