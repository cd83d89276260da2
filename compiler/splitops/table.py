"""How model code calls the ops: through an op table, chosen by whoever runs the model.

Models call `ops.gdn_core(q, k, v, g, beta, out, layer_id, scale)`, positional arguments in the
order of the op's schema. Two tables exist:

- `TRACED_OPS` (here) calls `torch.ops.hgc.*`, so tracing leaves one op node per call. The
  compiler exports a model with it.
- the runtime's `BoundOps` calls a backend with the step's ExecContext. The eager path
  (`hgc generate`) runs a model with it, and the loader binds op nodes of a graph to it.

No global decides which is in use: a model holds the table it was given.
"""

from __future__ import annotations

import torch

from .ops import OP_SPECS, op_spec

__all__ = ["TracedOps", "TRACED_OPS"]


class TracedOps:
    """An op table whose entries are the `torch.ops.hgc` ops themselves."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        op_spec(name)  # a clear KeyError for a name outside the vocabulary
        return getattr(torch.ops.hgc, name).default

    def __dir__(self):
        return sorted(OP_SPECS)


TRACED_OPS = TracedOps()
