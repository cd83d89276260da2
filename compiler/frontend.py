"""Frontend: a checkpoint directory's config.json -> exported FX programs, on the meta device.

1. Read config.json and find the family (the toolchain's `read_model`: models/loader.load_config,
   handed in by the command line, so the compiler imports no model code); build the model under
   torch.device("meta") in the compile dtype: no weight is read or allocated, so a 1T-parameter
   layout traces as fast as a tiny one.
2. Pick example sizes: the token count T (shared by input_ids, positions and, for the draft,
   hidden) and the logits row count R, each >= 2 and unequal to every static dimension of the
   model, so torch.export cannot mistake a token dimension for a weight dimension.
3. `torch.export.export(strict=False)` the model's forward as program "main" and, where the model
   has a draft (MTP) module, its forward as program "draft"; the main program of such a model
   returns its final hidden states too (`MainWithHidden`, what `program_outputs` in the artifact
   format says). Both dimensions are dynamic (below).
   The model holds the traced op table (TRACED_OPS), so each hgc op call is one in-place
   `torch.ops.hgc.<op>.default` node; no decomposition runs after export, which keeps it so.
4. Map every lifted parameter, buffer and constant of each program to the checkpoint tensors
   that fill it (`ParamSource`: views by storage identity, found on the meta model without data),
   and list the inputs no checkpoint tensor covers (a lint reports them).

Tensor parallel (`tp` > 1): the traced model is the one every rank runs (`family.build(text,
tp)`: heads and widths divided, models/common.py); a count that does not divide fails its build
with a `ShardingError` naming the layer. The whole model is built on the meta device beside it,
and each checkpoint tensor's whole and rank shapes (with the fused layouts both declare) become
`ShardFact`s, from which the sharding pass derives how each rank reads it. Tensors the rank model
computes from its config (`computed_tensors`) are materialised here, whole, for the artifact.

Why R (the logits_index length) is dynamic too: the runtime asks for one logits row per request,
and the number of requests in a step changes every step (and differs from T in extend steps).
A static R would bake one batch size into the graph. It is its own dimension, not T's: in
decode R == T, in extend R < T, and export must not assume either.

What it does not do: run the model, read weights, choose backends or split (passes do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import defaultdict
from typing import Optional

import torch
import torch.fx.config
import torch.nn as nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from compiler.splitops.errors import CompileError
from compiler.splitops import STATE_DTYPES, TRACED_OPS, LayerRegistry, RegistryError
from compiler.splitops.artifact import PROGRAM_INPUTS, ParamSource, TensorView, program_outputs

__all__ = ["FrontendError", "TracedModel", "trace_checkpoint", "trace_model", "build_model", "example_sizes", "export_programs",
           "bind_weights", "DraftProgram", "MainWithHidden", "ShardFact", "shard_facts"]


class FrontendError(CompileError):
    pass


@dataclasses.dataclass(frozen=True)
class ShardFact:
    """One checkpoint tensor seen by tensor parallelism: its whole shape, its shape on a rank, and
    the (dim, segment lengths) of a fused layout in each, where the model declares one."""

    whole: tuple[int, ...]
    rank: tuple[int, ...]
    whole_segments: Optional[tuple[int, tuple[int, ...]]] = None
    rank_segments: Optional[tuple[int, tuple[int, ...]]] = None


@dataclasses.dataclass
class TracedModel:
    family: object  # models.families.Family
    config: dict  # config.json as written
    text_config: dict  # the family's validated flat config
    dtype: str
    model: nn.Module  # the meta model (kept for its structure; holds no data)
    registry: LayerRegistry
    programs: dict[str, ExportedProgram]  # "main", and "draft" where the model has one
    sizes: dict[str, int]  # example sizes used: {"T": ..., "R": ...}
    tensors: dict[str, ParamSource]  # model FQN -> checkpoint views filling it
    program_fqns: dict[str, dict[str, str]]  # program -> {program FQN: model FQN}
    missing: dict[str, list[str]]  # program -> lifted FQNs no checkpoint tensor covers
    tp: int = 1  # the rank count the programs are one rank of
    whole_registry: Optional[LayerRegistry] = None  # the whole model's registry (tp > 1; `registry` is a rank's)
    shard_facts: dict[str, ShardFact] = dataclasses.field(default_factory=dict)  # checkpoint name -> facts (tp > 1)
    computed: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # computed tensors, whole, CPU


class DraftProgram(nn.Module):
    """The draft's forward as a root module that owns the whole model.

    Exporting `model.draft` alone would leave the tensors it borrows from the main model (the
    shared embedding and lm_head) unregistered, and export would freeze them as constants. As an
    attribute of this root, every model tensor is a parameter under FQN "lm.<model FQN>".
    """

    prefix = "lm."

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, positions, hidden, logits_index):
        return self.lm.draft(input_ids, positions, hidden, logits_index)


class MainWithHidden(nn.Module):
    """The main forward of a model with a draft: (logits [R, V], final hidden states [T, D]).

    The draft's first position after a main step reads the main model's hidden state there
    (speculative decoding, runtime/engine/speculative.py), so the program hands it out beside the
    logits. The model's own children, parameters and buffers are registered on this root under
    their own names, so the program's FQNs, node names and module paths are the model's.
    Families with a draft implement `forward_hidden` and `compute_logits` (models/common.py).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        for name, child in lm.named_children():
            self.add_module(name, child)
        for name, p in lm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in lm.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self.__dict__["_lm"] = lm  # not a submodule: its tensors are registered above, once

    def forward(self, input_ids, positions, logits_index):
        hidden = self._lm.forward_hidden(input_ids, positions)  # [T, D]
        return self._lm.compute_logits(hidden, logits_index), hidden


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FrontendError(f"frontend: unknown dtype {name!r} (use float32, bfloat16 or float16)")
    return dtype


def build_model(family, text_config: dict, dtype: str, tp: int = 1, state_dtype: str = "float32") -> nn.Module:
    """The family's model (one rank of `tp`) on the meta device, in `dtype`, with the traced op table;
    its registry keeps recurrent states in `state_dtype` (the traced ops take the state pool by
    layer id, so the graph does not depend on it: the pool and the kernels do)."""
    # The registry's cache dtypes come from the config's dtype fields, and the caches must hold
    # what the traced model computes: a float32 config compiled in bfloat16 gets a bfloat16 KV
    # cache (FlashInfer plans attention for one q/kv dtype pair), not a float32 one.
    text_config = {**text_config, "dtype": dtype, "torch_dtype": dtype}
    try:
        with torch.device("meta"):
            model = family.build(text_config, tp) if tp > 1 else family.build(text_config)
    except RegistryError as e:
        raise FrontendError(f"frontend: the {family.name} model builds an invalid LayerRegistry: {e}; fix: each layer "
                            f"id once, draft layers after the main ones (models/{family.name}.py)") from None
    model = model.to(_dtype(dtype)).eval()
    model.set_ops(TRACED_OPS)
    if not isinstance(getattr(model, "layer_registry", None), LayerRegistry):
        raise FrontendError(f"frontend: the {family.name} model has no layer_registry (a LayerRegistry); "
                            f"models/ must set it in __init__")
    model.layer_registry = model.layer_registry.with_state_dtype(state_dtype)
    return model


def _static_dims(model: nn.Module, text_config: dict) -> set[int]:
    dims: set[int] = {0, 1}
    for t in list(model.parameters()) + list(model.buffers()):
        dims.update(int(s) for s in t.shape)
    for layer in model.layer_registry:
        for spec in list(layer.kv.values()) + list(layer.state.values()):
            dims.update(spec.shape)

    def walk(value):
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            dims.add(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(text_config)
    return dims


def example_sizes(model: nn.Module, text_config: dict) -> dict[str, int]:
    """R then T: the two smallest integers >= 2 that are no static dimension of the model."""
    taken = _static_dims(model, text_config)
    picks = []
    n = 2
    while len(picks) < 2:
        if n not in taken:
            picks.append(n)
        n += 1
    return {"R": picks[0], "T": picks[1]}


@contextlib.contextmanager
def _without_stack_traces():
    """Export without recording a Python stack trace per node.

    The traces hold absolute source paths (graph.pt2 would differ between two checkouts of the
    same code) and cost about a quarter of the export time; nothing in hgc reads them (lints and
    dumps use nn_module_stack, which is kept). torch reads this flag from its fx config module,
    so it is set for the duration of the export and restored after.
    """
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):  # torch < 2.12 has no such flag
        yield
        return
    old = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = old


def export_programs(model: nn.Module, sizes: dict[str, int], hidden_size: int,
                    family_name: str = "model") -> dict[str, ExportedProgram]:
    T = Dim("T", min=1)  # one token at least: decode of a single request
    R = Dim("R", min=1)
    ids = torch.zeros(sizes["T"], dtype=torch.long, device="meta")
    positions = torch.zeros(sizes["T"], dtype=torch.long, device="meta")
    rows = torch.zeros(sizes["R"], dtype=torch.long, device="meta")
    has_draft = getattr(model, "draft", None) is not None
    main = MainWithHidden(model) if has_draft else model
    jobs = {"main": (main, (ids, positions, rows), {"input_ids": {0: T}, "positions": {0: T}, "logits_index": {0: R}})}
    if has_draft:
        hidden = torch.zeros(sizes["T"], hidden_size, dtype=next(model.parameters()).dtype, device="meta")
        jobs["draft"] = (DraftProgram(model), (ids, positions, hidden, rows),
                         {"input_ids": {0: T}, "positions": {0: T}, "hidden": {0: T}, "logits_index": {0: R}})
    programs = {}
    for name, (module, args, dynamic) in jobs.items():
        try:
            with _without_stack_traces():
                ep = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FrontendError(
                f"frontend: torch.export of the {family_name} {name} program failed: {type(e).__name__}: {first}; "
                f"fix: the model must trace on the meta device with a dynamic token count (no data-dependent "
                f"Python branches, no reads of tensor values, shapes from the config only)") from e
        # The example inputs would be pickled into graph.pt2; the artifact needs none, and leaving
        # them out keeps graph.pt2 byte-identical across compiles and free of pickle payloads.
        ep.example_inputs = None
        _check_inplace_ops(ep, name)
        users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        if tuple(users) != PROGRAM_INPUTS[name]:
            raise FrontendError(f"frontend: the {name} program takes inputs {users}, expected {list(PROGRAM_INPUTS[name])}; "
                                f"fix: keep the model's forward signature (models/common.py)")
        outputs = program_outputs(name, jobs)
        returned = sum(s.kind == OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs)
        if returned != len(outputs):
            raise FrontendError(f"frontend: the {name} program returns {returned} tensor(s), expected {len(outputs)} "
                                f"({', '.join(outputs)}); fix: the draft returns (logits, hidden) (models/common.py)")
        programs[name] = ep
    return programs


def _check_inplace_ops(ep: ExportedProgram, program: str) -> None:
    """Every hgc op call must stay one in-place node; a functionalised export would wrap it in
    `auto_functionalized` (with copies) and the runtime could no longer bind it to a backend."""
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        wrapped = "auto_functionalized" in str(node.target) and any(
            "hgc" in str(a) for a in list(node.args) + list(node.kwargs.values()))
        if wrapped:
            raise FrontendError(f"frontend: the {program} program wraps an hgc op in {node.target} (node {node.name}); "
                                f"fix: export without run_decompositions / functionalisation")


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _resolve(model: nn.Module, fqn: str):
    obj = model
    for part in fqn.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def bind_weights(model: nn.Module, programs: dict[str, ExportedProgram]):
    """(model FQN -> ParamSource, program -> {program FQN: model FQN}, program -> uncovered FQNs)."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, t in model.checkpoint_tensors(held=True).items():
        by_storage[_storage_key(t)].append((name, t))
    row_orders = model.row_orders()
    tensors: dict[str, ParamSource] = {}
    program_fqns: dict[str, dict[str, str]] = {}
    missing: dict[str, list[str]] = {}
    for program, ep in programs.items():
        prefix = DraftProgram.prefix if program == "draft" else ""
        mapping, lacking = {}, []
        lifted = [s.target for s in ep.graph_signature.input_specs
                  if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)]
        for fqn in lifted:
            model_fqn = fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn
            if model_fqn not in tensors:
                t = _resolve(model, model_fqn)
                source = _source_of(t, by_storage, row_orders) if t is not None else None
                if source is None:
                    lacking.append(fqn)
                    continue
                tensors[model_fqn] = source
            mapping[fqn] = model_fqn
        program_fqns[program] = mapping
        missing[program] = lacking
    return tensors, program_fqns, missing


def _source_of(t: torch.Tensor, by_storage, row_orders) -> ParamSource | None:
    """The checkpoint views that fill `t` exactly (one each per distinct region, with the order the
    model holds its rows in where that is not the checkpoint's), or None if they do not."""
    views, seen = [], set()
    for name, v in by_storage.get(_storage_key(t), []):
        geometry = (v.storage_offset() - t.storage_offset(), tuple(v.shape), tuple(v.stride()))
        if geometry in seen:
            continue  # a tied name for the same region: one source is enough
        seen.add(geometry)
        views.append(TensorView(name, *geometry, rows=row_orders.get(name)))
    covered = sum(v.numel for v in views)
    if not views or covered != t.numel():
        return None
    return ParamSource(tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(views))


def shard_facts(whole: nn.Module, rank: nn.Module) -> dict[str, ShardFact]:
    """Checkpoint name -> ShardFact, from the whole model and a rank model (both on the meta device).
    A computed tensor's whole shape is that of its whole value (`rank.computed_tensors()`)."""
    whole_shapes = {name: shape for name, (shape, _) in whole.checkpoint_shapes().items()}
    whole_shapes.update({name: tuple(t.shape) for name, t in rank.computed_tensors().items()})
    whole_fused, rank_fused = whole.fused_segments(), rank.fused_segments()
    facts = {}
    for name, (shape, _) in rank.checkpoint_shapes().items():
        if name not in whole_shapes:
            raise FrontendError(f"frontend: the rank model has tensor {name!r}, which the whole model lacks and "
                                f"computed_tensors() does not give; fix the family's rank build (models/)")
        facts[name] = ShardFact(whole_shapes[name], shape, whole_fused.get(name), rank_fused.get(name))
    return facts


def trace_model(model: nn.Module, family, config: dict, text_config: dict, dtype: str,
                whole: Optional[nn.Module] = None) -> TracedModel:
    """Steps 2-4 for a model already built on the meta device (tests pass toy models here).
    `whole`: for a rank model (model.tp > 1), the whole model it is one rank of."""
    sizes = example_sizes(model, text_config)
    programs = export_programs(model, sizes, int(text_config["hidden_size"]), family.name)
    tensors, program_fqns, missing = bind_weights(model, programs)
    traced = TracedModel(family, config, text_config, dtype, model, model.layer_registry, programs, sizes, tensors,
                         program_fqns, missing)
    if whole is not None:
        traced.tp, traced.whole_registry = model.tp, whole.layer_registry
        traced.shard_facts = shard_facts(whole, model)
        traced.computed = dict(model.computed_tensors())
    return traced


def state_dtype_of(text_config: dict, asked: Optional[str]) -> str:
    """What the registry keeps recurrent states in: `asked` (--state-dtype), else the checkpoint's
    `mamba_ssm_dtype` (Qwen3.5's configs name float32, as vLLM reads them), else float32."""
    if asked is not None:
        return asked
    named = text_config.get("mamba_ssm_dtype")
    if named is None:
        return "float32"
    if named not in STATE_DTYPES:
        raise FrontendError(f"frontend: config.json: mamba_ssm_dtype {named!r} is not a state dtype hgc keeps "
                            f"({', '.join(STATE_DTYPES)}); pass --state-dtype to choose one")
    return named


def trace_checkpoint(ckpt_dir: str | os.PathLike, dtype: str, read_model, tp: int = 1,
                     state_dtype: Optional[str] = None) -> TracedModel:
    """Steps 1-4 of the module docstring for one checkpoint directory (config.json is all it reads).

    read_model(ckpt_dir) -> (family, config.json, text config): compiler/toolchain.py.
    tp > 1: the programs of one rank of `tp` (see "Tensor parallel" above). state_dtype: what the
    registry keeps recurrent states in (`--state-dtype`; None: `state_dtype_of` the config)."""
    family, config, text = read_model(ckpt_dir)
    state_dtype = state_dtype_of(text, state_dtype)
    model = build_model(family, text, dtype, tp, state_dtype)
    whole = build_model(family, text, dtype, state_dtype=state_dtype) if tp > 1 else None
    return trace_model(model, family, config, text, dtype, whole)
