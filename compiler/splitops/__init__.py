"""The op vocabulary shared by models, compiler and runtime (depends on torch only): the ground floor.

    ops.py         one torch.library op per attention-like core, its capture policy, its arguments
    shared_expert.py  the MoE shared expert's math (the CPU reference's, and what --overlap traces into a graph)
    gdn_mixer.py   the GDN mixer between its projections (the models', the fusion pass's, the gdn_fused op's)
    policy.py      forward modes and capture policies
    registry.py    the LayerRegistry: one entry per layer id, the single source of truth for kinds
    table.py       TRACED_OPS: the op table models are traced with
    capability.py  what a backend declares it can do, and the table routing reads
    artifact.py    the artifact format: file names, documents, split-plan re-application
    sharding.py    tensor parallelism: how a tensor is cut across ranks, the divisibility rule
    rows.py        row orders: rows a checkpoint stores per group and a model holds per segment
    bundle.py      the target bundle format: compiled code for one device and torch build, and its target
    glue.py        where a program's glue is cut from its op cores (what Inductor compiles)
    glue_ops.py    ops of the compiled glue (hgc_glue::small_m_linear, the input norm folded into a projection),
                   not op cores; imported where pieces load
    errors.py      CompileError, raised and caught by every layer above
"""

from .capability import (DTYPES, BackendCapability, CapabilityError, CapabilityTable, ChoiceScope, OpCapture,
                         OptionDtypes, ShapeLimit, instance_key)
from .errors import CompileError
from .ops import (COLLECTIVE_OPS, FUSED_OPS, OP_SPECS, UNFUSED, OPS_BY_KIND, CallFacts, OpSpec, call_arguments, call_facts, is_hgc_op, is_op_node,
                  moe_shared_width, op_arguments, op_name_of, op_nodes, op_schemas, op_spec)
from .policy import MODES, Capture, Mode
from .rows import GroupedRows
from .sharding import REPLICATED, ShardingError, ShardSpec, split_count
from .registry import (FULL_KINDS, LINEAR_KINDS, STATE_DTYPES, LayerKind, LayerRegistry, LayerSpec, RegistryError,
                       TensorSpec, dtype_from_name)
from .table import TRACED_OPS, TracedOps

__all__ = [
    "COLLECTIVE_OPS", "FUSED_OPS", "UNFUSED", "OP_SPECS", "OPS_BY_KIND", "OpSpec", "is_hgc_op", "moe_shared_width", "op_name_of", "op_schemas", "op_spec",
    "op_arguments", "call_arguments", "CallFacts", "call_facts", "is_op_node", "op_nodes",
    "MODES", "Capture", "Mode",
    "FULL_KINDS", "LINEAR_KINDS", "LayerKind", "LayerRegistry", "LayerSpec", "RegistryError",
    "STATE_DTYPES", "TensorSpec", "dtype_from_name",
    "TRACED_OPS", "TracedOps",
    "DTYPES", "BackendCapability", "CapabilityError", "CapabilityTable", "ChoiceScope", "OpCapture", "OptionDtypes",
    "ShapeLimit", "instance_key",
    "CompileError",
    "REPLICATED", "ShardingError", "ShardSpec", "split_count",
    "GroupedRows",
]
