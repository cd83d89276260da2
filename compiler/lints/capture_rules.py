"""Rules about what will be captured in a CUDA graph (they run after the split pass).

"Captured" means: inside a piece of kind "captured" of a mode's split plan. In decode and
target_verify the whole graph is one captured piece, so anything these rules flag is captured in
at least one mode.

- stateful-op-captured:        an hgc op that mutates its layer's cache or state sits in a captured
                               piece of a mode where its declared policy says eager (failure 2: a
                               linear-attention kernel captured during prefill, GSM8K 86.7% -> 16.5%).
                               Fires on a broken or stale split plan.
- state-mutation-outside-ops:  the graph mutates state the op vocabulary does not know about: a
                               weight, module buffer or input written in place (export's training IR
                               keeps such writes as in-place nodes on the placeholder), or a custom op
                               outside `hgc` with mutable arguments (the same failure, by another road).
- host-sync-captured:          a host synchronisation (.item(), .tolist(), .cpu(), nonzero, boolean
                               masks) or a data-dependent shape (an unbacked symbol) in a captured piece;
                               on a device target also a host tensor copied to the device.
- input-without-checkpoint-tensor: a lifted parameter, buffer or constant with no checkpoint tensor:
                               the weightless artifact would have no value for it.
- captured-beyond-backend:      an op node sits in a captured piece of a mode its routed backend does
                               not declare capturable (the split pass never plans that: a plan recorded
                               for another routing, or edited).
- backend-cannot-capture (warning): on a capturing target, an op whose policy allows capture in a
                               mode is routed to a backend that cannot be captured in it (the split
                               pass makes the node an eager gap there); a note (info) where the backend
                               captures it in steps of up to some tokens (whole-step graphs of the
                               buckets up to that, an eager gap above).
- whole-extend-bound-off-buckets: that bound is no extend bucket of the compile and some bucket is
                               larger: a step under it would replay another kernel than its eager run.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from compiler.lints.base import ERROR, INFO, WARNING, Finding, LintRule
from compiler.splitops import MODES, Capture, Mode, is_op_node, op_name_of, op_nodes, op_spec
from compiler.splitops.artifact import CAPTURED, whole_bound_refusal

__all__ = ["StatefulOpCaptured", "CapturedBeyondBackend", "StateMutationOutsideOps", "HostSyncCaptured",
           "InputWithoutCheckpointTensor", "BackendCannotCapture", "WholeExtendBoundOffBuckets", "CAPTURE_RULES", "host_sync_reason",
           "host_to_device_reason"]

_aten = torch.ops.aten
# Ops that read a device value back to the host, or whose output shape depends on tensor values.
_SYNC_OPS = {
    _aten.item.default: ".item() reads a device scalar on the host",
    _aten._local_scalar_dense.default: ".item() / .tolist() reads a device scalar on the host",
    _aten.nonzero.default: "nonzero has a data-dependent output shape",
    _aten.masked_select.default: "masked_select has a data-dependent output shape",
    _aten.equal.default: "torch.equal returns a host bool",
    _aten.is_nonzero.default: "bool(tensor) reads a device value on the host",
}
_COPY_OPS = {_aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device}


def _captured_modes(ctx, node_name: str) -> list[str]:
    plans = ctx.split_plans.get(ctx.program, {})
    out = []
    for mode in MODES:
        plan = plans.get(mode)
        if plan is None:
            continue
        for piece in plan.pieces:
            if piece.kind == CAPTURED and node_name in piece.nodes:
                out.append(mode.value)
                break
    return out


def _copy_devices(node):
    """(source value, destination device type) of a copy node with an explicit device, else None."""
    if node.op != "call_function" or node.target not in _COPY_OPS:
        return None
    device = node.kwargs.get("device")
    if device is None and node.target is _aten.to.device and len(node.args) > 1:
        device = node.args[1]
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if device is None or getattr(src, "device", None) is None:
        return None
    return src, torch.device(device).type


def host_sync_reason(node) -> str | None:
    """Why `node` forces a host synchronisation (or a data-dependent shape), or None."""
    if node.op != "call_function":
        return None
    if node.target in _SYNC_OPS:
        return _SYNC_OPS[node.target]
    copy = _copy_devices(node)
    if copy is not None and copy[1] == "cpu" and copy[0].device.type != "cpu":
        return ".cpu() / .to('cpu') copies a device tensor to the host"
    return _data_dependent_reason(node)


def host_to_device_reason(node) -> str | None:
    """Why `node` copies a host tensor to the device, or None.

    Programs are traced on the meta device, which stands for the target's device; a tensor made
    without a device (torch.arange(n), torch.tensor([...])) is a host tensor, and moving it over
    is a copy from pageable host memory, which a CUDA graph capture refuses. On a CPU target
    nothing is copied, so the caller asks only for device targets. (0-dim host tensors are
    scalars that kernels take by value: no copy.)
    """
    copy = _copy_devices(node)
    if copy is not None and copy[1] != "cpu" and copy[0].device.type == "cpu" and copy[0].dim() > 0:
        return "it copies a host tensor to the device (made without device=, e.g. torch.arange(n))"
    return None


def _data_dependent_reason(node) -> str | None:
    val = node.meta.get("val")
    try:
        unbacked = free_unbacked_symbols(val) if val is not None else set()
    except Exception:  # a meta value the symbolic helpers do not understand: not a symbol
        unbacked = set()
    if unbacked:
        names = ", ".join(sorted(str(s) for s in unbacked))
        return f"its output depends on tensor values (data-dependent size {names})"
    return None


def _captured_op_nodes(gm, ctx):
    """(mode, piece index, op node) for every op node inside a captured piece of this program's plans."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for mode, plan in ctx.split_plans.get(ctx.program, {}).items():
        for piece in plan.pieces:
            if piece.kind != CAPTURED:
                continue
            for name in piece.nodes:
                node = by_name.get(name)
                if node is not None and is_op_node(node):
                    yield mode, piece.index, node


class StatefulOpCaptured(LintRule):
    id = "stateful-op-captured"
    severity = ERROR
    failure = 2
    doc = "no cache/state-mutating op in a captured piece of a mode where its policy says eager"

    def check(self, gm, ctx):
        for mode, piece, node in _captured_op_nodes(gm, ctx):
            spec = op_spec(op_name_of(node.target))
            if spec.stateful and spec.capture(mode) is Capture.EAGER:
                yield self.finding(
                    f"hgc.{spec.name} of layer {node.meta.get('hgc.layer_id')} mutates its cache/state and "
                    f"would be captured in mode {mode.value} (piece {piece}), where its declared policy "
                    f"says eager: replays would reuse stale per-request metadata",
                    "re-run the split pass (a split.json edited or recorded for another graph); never "
                    "hand-edit a plan", program=ctx.program, node=node.name, layer_id=node.meta.get("hgc.layer_id"))


class CapturedBeyondBackend(LintRule):
    id = "captured-beyond-backend"
    severity = ERROR
    failure = 2
    doc = "no op node in a captured piece of a mode its routed backend cannot be captured in"

    def check(self, gm, ctx):
        for mode, piece, node in _captured_op_nodes(gm, ctx):
            backend = node.meta.get("hgc.backend")
            if backend in ctx.capabilities and not ctx.capabilities[backend].capturable(
                    node.meta["hgc.op"], mode, node.meta.get("hgc.backend_options")):
                layer_id = node.meta.get("hgc.layer_id")
                yield self.finding(
                    f"hgc.{node.meta['hgc.op']} of layer {layer_id} is routed to {backend}, which declares "
                    f"no capture in mode {mode.value}, yet sits in captured piece {piece}: its "
                    f"kernels would be frozen into a CUDA graph they were never made for",
                    "re-run the split pass after routing (it makes such a node an eager gap); never "
                    "hand-edit a plan", program=ctx.program, node=node.name, layer_id=layer_id, backend=backend)


def _alias_base(node):
    """Follow view ops (whose output aliases their first input) back to the tensor they view."""
    seen = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and seen < 64:
        schema = getattr(node.target, "_schema", None)
        returns = getattr(schema, "returns", None) or []
        if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write or not node.args:
            break
        node, seen = node.args[0], seen + 1
    return node


def _written_args(node) -> list:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


class StateMutationOutsideOps(LintRule):
    id = "state-mutation-outside-ops"
    severity = ERROR
    doc = "state is only mutated by hgc ops (no in-place write to a weight, buffer or input; no foreign mutating op captured)"

    def check(self, gm, ctx):
        signature = ctx.signatures.get(ctx.program)
        lifted = {}
        if signature is not None:
            lifted = {s.arg.name: (s.kind, s.target or s.arg.name) for s in signature.input_specs}
        for node in gm.graph.nodes:
            if node.op != "call_function" or is_op_node(node):
                continue
            for written in _written_args(node):
                base = _alias_base(written)
                if isinstance(base, torch.fx.Node) and base.op == "placeholder":
                    kind, target = lifted.get(base.name, (None, base.name))
                    what = getattr(kind, "name", "INPUT").lower().replace("user_input", "input")
                    yield self.finding(
                        f"node {node.name} writes {what} {target!r} in place: state kept in a module (or an input) is "
                        f"invisible to the runtime's pools and would be captured in every mode",
                        "keep caches and states out of modules: call an hgc op, which reaches its layer's state "
                        "through the runtime by layer id", program=ctx.program, node=node.name)
            schema = getattr(node.target, "_schema", None)
            namespace = getattr(node.target, "namespace", None)
            if schema is None or namespace in ("aten", "prims", "hgc", None) or not schema.is_mutable:
                continue
            modes = _captured_modes(ctx, node.name)
            if modes:
                yield self.finding(
                    f"node {node.name} calls {namespace}::{schema.name.split('::')[-1]}, a custom op outside the hgc "
                    f"vocabulary that mutates its arguments; it would be captured in mode(s) {', '.join(modes)} with "
                    f"no declared capture policy", "declare the kernel as an hgc op (compiler/splitops/ops.py) with its "
                    "capture policy, and call it through self.ops", program=ctx.program, node=node.name)


class HostSyncCaptured(LintRule):
    id = "host-sync-captured"
    severity = ERROR
    doc = "no host synchronisation or data-dependent shape inside a captured piece"

    def check(self, gm, ctx):
        on_device = ctx.config.target != "cpu"
        for node in gm.graph.nodes:
            if is_op_node(node):
                continue
            reason = host_sync_reason(node) or (host_to_device_reason(node) if on_device else None)
            if reason is None:
                continue
            modes = _captured_modes(ctx, node.name)
            if modes:
                stack = node.meta.get("nn_module_stack") or {}
                module = list(stack.values())[-1][0] if stack else "the model's forward"
                yield self.finding(
                    f"node {node.name} (in {module}) would be captured in mode(s) {', '.join(modes)}, but {reason}: "
                    f"a CUDA graph cannot replay it",
                    "compute the value on the device without reading it back (fixed shapes, torch.where instead of "
                    "boolean masks; tensors made with device=the input's device), or move the work into an hgc op "
                    "whose backend does it outside the graph",
                    program=ctx.program, node=node.name)


class InputWithoutCheckpointTensor(LintRule):
    id = "input-without-checkpoint-tensor"
    severity = ERROR
    doc = "every lifted parameter, buffer and constant of a program has checkpoint tensors covering it"

    def check(self, gm, ctx):
        for fqn in ctx.missing_weights.get(ctx.program, []):
            yield self.finding(
                f"program input {fqn!r} is not covered by checkpoint tensors: the artifact is weightless (traced on "
                f"the meta device), so the runtime would have no value for it",
                "compute it inside forward from constants (it then becomes graph ops), or make it a persistent "
                "tensor that the checkpoint stores", program=ctx.program, node=fqn)


class BackendCannotCapture(LintRule):
    id = "backend-cannot-capture"
    severity = WARNING
    doc = "on a capturing target, the routed backend can capture every mode the op's policy allows"

    def check(self, gm, ctx):
        if ctx.config.target == "cpu":  # nothing is ever captured on the CPU
            return
        for node in op_nodes(gm):
            name = node.meta.get("hgc.backend")
            if name is None or name not in ctx.capabilities:
                continue
            cap = ctx.capabilities[name]
            spec = op_spec(node.meta["hgc.op"])
            options = node.meta.get("hgc.backend_options")
            wanted = [m for m in MODES if spec.capture(m) is Capture.CAPTURABLE and not cap.capturable(spec.name, m, options)]
            bounds = {m.value: n for m in wanted if (n := cap.capture_tokens(spec.name, m, options))}
            lost = [m.value for m in wanted if m.value not in bounds]
            if bounds:
                yield self._bounded(node, spec.name, name, cap, options, bounds, ctx)
            if lost:
                # kernel options under which the same backend captures it there (an `op_capture` entry)
                other = next((e for e in cap.op_capture if e.op == spec.name and e.when
                              and {m.value for m in e.modes} >= set(lost)), None)
                fix = (f"route it with {name}[{','.join(f'{k}={v}' for k, v in other.when)}], which {name} can "
                       f"capture there" if other is not None else
                       f"declare capture support in {name}'s capability, or add a backend that has it")
                yield self.finding(
                    f"layer {node.meta['hgc.layer_id']}'s hgc.{spec.name} runs on {name}, which cannot be captured in "
                    f"mode(s) {', '.join(lost)}; the split makes it an eager gap there", fix,
                    program=ctx.program, node=node.name, layer_id=node.meta["hgc.layer_id"], backend=name)

    def _bounded(self, node, op, name, cap, options, bounds, ctx) -> Finding:
        """A note, not a warning: the op is captured in the small steps' whole-step graphs (split.json's
        whole_up_to) and an eager gap in the pieces of larger ones, by a kernel option's choice."""
        resolved = cap.resolve_options(options or {})
        named = list(dict.fromkeys(e.up_to for e in cap.op_capture if e.up_to and e.op == op))
        set_by = ", ".join(f"{o}={resolved[o]}" for o in named)
        by_bound: dict[int, list[str]] = {}
        for mode, n in bounds.items():
            by_bound.setdefault(n, []).append(mode)
        modes = ", ".join(f"{' and '.join(ms)} steps of up to {n} tokens" for n, ms in by_bound.items())
        unbounded = next((e for e in cap.op_capture if e.op == op and e.when and not e.up_to
                          and {m.value for m in e.modes} >= set(bounds)), None)
        fix = (f"route it with {name}[{','.join(f'{k}={v}' for k, v in unbounded.when)}] for whole-step graphs at "
               f"every size" if unbounded is not None else f"route it with another {' or '.join(named)} to move the bound")
        return Finding(self.id, INFO,
                       f"layer {node.meta['hgc.layer_id']}'s hgc.{op} runs on {name}, captured in {modes} ({set_by}): "
                       f"the extend buckets up to that are whole-step graphs, larger ones pieces with it in an eager gap",
                       fix, program=ctx.program, node=node.name, layer_id=node.meta["hgc.layer_id"], backend=name)


class WholeExtendBoundOffBuckets(LintRule):
    id = "whole-extend-bound-off-buckets"
    severity = ERROR
    doc = "a bound on the steps whose gaps whole-step graphs capture is one of the extend buckets, or above them"

    def check(self, gm, ctx):
        plans = ctx.split_plans.get(ctx.program)
        why = plans and Mode.EXTEND in plans and whole_bound_refusal(plans, ctx.config.extend_token_counts)
        if why:
            yield self.finding(why, "set the kernel option that bounds it to one of the extend buckets (or 0: pieces "
                                    "everywhere), or compile with --extend-buckets that hold it",
                               program=ctx.program)


CAPTURE_RULES: tuple[LintRule, ...] = (
    StatefulOpCaptured(), CapturedBeyondBackend(), StateMutationOutsideOps(), HostSyncCaptured(),
    InputWithoutCheckpointTensor(), BackendCannotCapture(), WholeExtendBoundOffBuckets(),
)
