"""CompileContext: the state every pass reads and extends; CompileConfig: the settings of one compile.

Made once per compile by `compiler/pipeline.py`, handed to every pass and instrument, then read by
the artifact writer. There is no global "current compile": whatever a pass needs is here.

1. The frontend fills `registry` (the model's LayerRegistry: the single source of truth for layer
   kinds), `programs` (name -> GraphModule of each exported program) and `signatures`.
2. The pipeline adds `capabilities` (the backends' capability table) and `backend_wrappers`, both
   from the Toolchain the command line hands it (compiler/toolchain.py).
3. Passes add their results: `fusion`, `routing`, `split_plans`, `findings` (and, for --tp > 1, the
   sharding pass's `shard_specs` and `sharding`); `program` says which program the current pass
   call is working on.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.fx

from compiler.splitops import STATE_DTYPES, CapabilityTable, LayerRegistry, Mode
from compiler.splitops.artifact import (BUCKET_CHOICES, DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS,
                                        BucketCosts, SplitPlan)
from compiler.lints.base import Finding
from compiler.passes.routing import Route

__all__ = ["CompileConfig", "CompileContext"]


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Settings of one compile; every field that changes the artifact is recorded in the manifest."""

    target: str = "cpu"  # the device routing binds backends for
    dtype: str = "float32"  # the model dtype the graph is traced in (must match the eager baseline's)
    decode_batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCH_SIZES
    extend_token_counts: tuple[int, ...] = DEFAULT_EXTEND_TOKEN_COUNTS
    buckets_chosen_by: str = "defaults"  # how the buckets above were chosen (BUCKET_CHOICES), shown by `hgc inspect`
    bucket_costs: Optional[BucketCosts] = None  # the measured costs they were chosen from ("measured" only)
    routes: tuple[Route, ...] = ()  # --route: nodes bound to a named backend (compiler/passes/routing.py)
    tp: int = 1  # --tp: tensor-parallel ranks; the programs are one rank's (compiler/passes/sharding.py)
    overlap: bool = False  # --overlap: shared experts out of the moe op, side-stream branches (compiler/passes/overlap.py)
    overlap_min_bytes: Optional[int] = None  # --overlap-min-bytes: the overlap pass's size rule (None: its default)
    # --batch-invariant: every decode and target_verify row computed bit for bit as the request's own
    # decode step alone would be (routing sets each backend's declared choices; the runtime routes
    # the glue's matrix products to a kernel of one launch shape: docs/DESIGN.md "Batch invariance")
    batch_invariant: bool = False
    # --state-dtype: the dtype linear layers keep their recurrent state in (STATE_DTYPES; the
    # registry's "recurrent" entries, which size and type the state pool). None: the checkpoint's
    # `mamba_ssm_dtype`, else float32 (compiler/frontend.py `state_dtype_of`)
    state_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        for field in ("decode_batch_sizes", "extend_token_counts"):
            values = getattr(self, field)
            if not values or any(int(v) < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"compile config: {field} must be increasing positive integers, got {list(values)}")
        if self.buckets_chosen_by not in BUCKET_CHOICES:
            raise ValueError(f"compile config: buckets_chosen_by must be one of {BUCKET_CHOICES}, "
                             f"not {self.buckets_chosen_by!r}")
        if (self.bucket_costs is not None) != (self.buckets_chosen_by == "measured"):
            raise ValueError("compile config: bucket_costs are recorded exactly when the buckets were chosen from them "
                             "(buckets_chosen_by 'measured')")
        if int(self.tp) != self.tp or self.tp < 1:
            raise ValueError(f"compile config: --tp must be a positive integer, got {self.tp!r}")
        if self.overlap_min_bytes is not None and (not self.overlap or self.overlap_min_bytes < 0):
            raise ValueError(f"compile config: --overlap-min-bytes {self.overlap_min_bytes} needs --overlap and a "
                             f"count of bytes >= 0")
        if self.batch_invariant and self.target.split(":")[0] != "cuda":
            raise ValueError(f"compile config: --batch-invariant is built for --target cuda (its matrix-product "
                             f"kernel is Triton's), not {self.target!r}")
        if self.batch_invariant and self.tp > 1:
            raise ValueError(f"compile config: --batch-invariant with --tp {self.tp}: an all-reduce's summation order "
                             f"follows its message size, so rows of a tensor-parallel step are not batch-invariant; "
                             f"drop one")
        if self.state_dtype is not None and self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"compile config: --state-dtype {self.state_dtype!r}: one of {', '.join(STATE_DTYPES)}")
        if self.overlap and self.tp > 1:
            raise ValueError(f"compile config: --overlap with --tp {self.tp}: the side-stream pass has not been "
                             f"built for tensor-parallel programs (the shared expert's partial sums); drop one")

    def to_json(self) -> dict:
        return {"target": self.target, "dtype": self.dtype, "decode_batch_sizes": list(self.decode_batch_sizes),
                "extend_token_counts": list(self.extend_token_counts), "routes": [str(r) for r in self.routes],
                "overlap": self.overlap,
                **({"batch_invariant": True} if self.batch_invariant else {}),
                **({"state_dtype": self.state_dtype} if self.state_dtype is not None else {}),
                **({"overlap_min_bytes": self.overlap_min_bytes} if self.overlap_min_bytes is not None else {}),
                **({"tp": self.tp} if self.tp > 1 else {})}


@dataclasses.dataclass
class CompileContext:
    registry: LayerRegistry
    capabilities: CapabilityTable  # the backends' declarations, handed in by the command line
    config: CompileConfig
    programs: dict[str, torch.fx.GraphModule]  # "main" first, then "draft" where the model has one
    signatures: dict[str, object] = dataclasses.field(default_factory=dict)  # program -> ExportGraphSignature
    backend_wrappers: tuple[type, ...] = ()  # wrapper backend classes for the hook-forwarding lint
    missing_weights: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # program -> lifted FQNs with no checkpoint tensor
    program: str = "main"  # the program the current pass call works on
    # tensor parallel (the frontend's facts for --tp > 1; compiler/passes/sharding.py reads them)
    tp: int = 1
    whole_registry: Optional[LayerRegistry] = None  # the whole model's (`registry` is one rank's)
    shard_facts: dict = dataclasses.field(default_factory=dict)  # checkpoint name -> frontend.ShardFact
    weight_sources: dict = dataclasses.field(default_factory=dict)  # program -> weight placeholder -> ParamSource

    # results
    routing: dict[str, list[dict]] = dataclasses.field(default_factory=dict)
    split_plans: dict[str, dict[Mode, SplitPlan]] = dataclasses.field(default_factory=dict)
    findings: list[Finding] = dataclasses.field(default_factory=list)
    shard_specs: dict = dataclasses.field(default_factory=dict)  # checkpoint name -> ShardSpec
    sharding: dict[str, list[dict]] = dataclasses.field(default_factory=dict)  # program -> collectives placed
    fusion: dict[str, dict] = dataclasses.field(default_factory=dict)  # program -> {"fused": [...], "unfused": [...]}
    stopped_after: Optional[str] = None  # the pass that ended the pipeline early, if one did

    @property
    def program_names(self) -> list[str]:
        return list(self.programs)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]
