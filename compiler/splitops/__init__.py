"""The op vocabulary shared by models, compiler and runtime (depends on torch only)."""

from .ops import OP_SPECS, OPS_BY_KIND, OpSpec, is_hgc_op, moe_shared_width, op_name_of, op_schemas, op_spec
from .policy import MODES, Capture, Mode
from .registry import (FULL_KINDS, LINEAR_KINDS, LayerKind, LayerRegistry, LayerSpec, RegistryError,
                       TensorSpec, dtype_from_name)
from .table import TRACED_OPS, TracedOps

__all__ = [
    "OP_SPECS", "OPS_BY_KIND", "OpSpec", "is_hgc_op", "moe_shared_width", "op_name_of", "op_schemas", "op_spec",
    "MODES", "Capture", "Mode",
    "FULL_KINDS", "LINEAR_KINDS", "LayerKind", "LayerRegistry", "LayerSpec", "RegistryError",
    "TensorSpec", "dtype_from_name",
    "TRACED_OPS", "TracedOps",
]
