"""Which op of a step each kernel belongs to, and what each op must move and compute: step_account.py's tracing.

How kernels are attributed (by FX nodes of the program, not by kernel-name patterns):

1. Every call_function node of the artifact's bound program gets a label (layer, what): the layer
   from the node's `nn_module_stack` ("model.layers.7..." -> 7; "-" outside the layers), and what it
   is: the hgc op it calls (`moe`, `gdn_core`, `gdn_fused`, ...), `gemm <module>` for a matmul (by the projection's
   module path, e.g. `gemm linear_attn.in_proj_qkvz`), `embedding`, else `glue`. With a target
   bundle, every node of a compiled glue segment, and the compiled call that runs it, takes the
   segment's label (the layer of its last node; `gemm (compiled glue)` for its matmuls and the
   library GEMM kernels inside the call, told by kernel name, `glue (compiled)` for the rest):
   Inductor fuses across nodes, so finer labels would be guesses.
2. `labelled(module, ...)` runs a step eagerly through the mode's split module with every labelled
   node inside a `torch.profiler.record_function("acct|layer|what")` range (each piece's forward is
   an fx Interpreter for the duration), and, when asked, each node's cost from its concrete
   tensors (account_cost.py).
3. `profile_kernels` lists a profiled call's kernels in the order they ran, each with the label of
   the range its launch sat in (a kernel's profiler event links to the torch op that launched it;
   its parents lead to the range). On the CPU, where there are no kernels, the profiler's leaf CPU
   ops stand in (the dry run).
4. The timed step (a replayed whole-step graph, or captured pieces) runs no Python per op, so its
   kernels carry no ranges: `align` matches its kernel-name sequence to the labelled eager run's
   (difflib), and each matched kernel takes its eager twin's label. Kernels only the replay has
   (the replay state a whole-step graph copies in first) stay `unmatched`.

It does not time anything itself and does not choose what runs (the runner does).
"""

from __future__ import annotations

import contextlib
import difflib
import operator
import re
import statistics
import types
from pathlib import Path
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from account_cost import (add_costs, attention_cost, cost, gemm_cost, linear_core_cost, moe_cost,
                          short_conv_cost)
from compiler.splitops import op_arguments, op_name_of
from compiler.splitops.artifact import piece_module_names
from compiler.splitops.glue import segment_pieces

__all__ = ["StepFacts", "node_labels", "labelled", "profile_kernels", "split_compiled", "per_call", "align",
           "timeline", "UNMATCHED", "LABEL"]

LABEL = "acct|"
CALL = "acct-call|"
UNMATCHED = ("-", "unmatched")
GEMMS = {"linear", "mm", "addmm", "matmul", "bmm"}
# ops that move no data: views, metadata checks, getitem of a tuple
FREE = {"view", "reshape", "_unsafe_view", "expand", "slice", "select", "permute", "transpose", "t", "unsqueeze",
        "squeeze", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "_assert_tensor_metadata",
        "getitem", "sym_size", "empty", "empty_like", "as_strided", "unflatten", "flatten"}
# A compiled glue segment is one call: its GEMMs (library kernels Inductor calls, told apart by
# name) and its fused elementwise kernels are all the finer labels can say.
COMPILED_GLUE, COMPILED_GEMM = "glue (compiled)", "gemm (compiled glue)"
GEMM_KERNEL = re.compile(r"nvjet|gemm|gemv|cutlass|xmma|cublas|aten::(mm|addmm|bmm)$", re.IGNORECASE)
CORE_KIND = {"gdn_core": "gdn", "kda_core": "kda", "lightning_core": "lightning"}


def _aten_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _op_of(node) -> str | None:
    return getattr(node.target, "hgc_op", None) or op_name_of(node.target)


def node_label(node) -> tuple[str, str]:
    """(layer, what) of one call_function node of the traced program."""
    path = _module_path(node)
    layer = re.search(r"layers\.(\d+)", path)
    where = layer.group(1) if layer else "-"
    op = _op_of(node)
    if op is not None:
        return where, op
    name = _aten_name(node.target)
    if name in GEMMS:
        tail = re.sub(r"^.*layers\.\d+\.", "", path).removeprefix("model.") or name
        return where, f"gemm {tail}"
    if name == "embedding":
        return where, "embedding"
    return where, "glue"


def node_labels(program, mode, module) -> dict:
    """{fx node: (layer, what)} for every call_function node of `module` (the mode's split module,
    traced or with compiled glue) and its pieces. program: the runner's ProgramRunner."""
    by_name = {n.name: node_label(n) for n in program._bound.graph.nodes if n.op == "call_function"}
    glue = getattr(program, "glue", None)
    segment_of: dict[str, tuple] = {}
    calls_of_piece: dict[str, list] = {}
    if glue is not None and getattr(glue, "_segments", None):
        plan = program.plans[mode]
        held = segment_pieces(glue._segments, plan, program.name)
        names = piece_module_names(plan)
        for segment, record in zip(glue._segments, glue.records):
            if record["piece"] is None:
                continue
            layer = by_name[segment.nodes[-1]][0]
            segment_of.update({n: (layer, COMPILED_GEMM if by_name[n][1].startswith("gemm ") else COMPILED_GLUE)
                               for n in segment.nodes})
            calls_of_piece.setdefault(names[held[segment.index]], []).append((layer, COMPILED_GLUE))
    labels = {}
    for name, sub in [("", module), *module.named_modules()]:
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        piece = next((part for part in name.split(".") if part.startswith("submod_")), "")
        compiled = iter(calls_of_piece.get(piece, ()))
        for n in sub.graph.nodes:
            if n.op != "call_function" or n.target is operator.getitem:
                continue
            if hasattr(n.target, "hgc_piece"):
                labels[n] = next(compiled, ("-", COMPILED_GLUE))
            elif n.name in segment_of:
                labels[n] = segment_of[n.name]
            elif n.name in by_name:
                labels[n] = by_name[n.name]
    return labels


@dataclass
class StepFacts:
    """What a node's cost needs beyond its tensors: the step's requests and the pools' per-layer sizes."""

    query_lens: list[int]
    cache_lens: list[int]
    kv_bytes_per_token: dict[int, int]  # full layers: every KV entry of one token, in the pool's dtype
    state_bytes: dict[int, dict[str, int]]  # linear layers: each state of one request's slot
    weight_ptrs: set = field(default_factory=set)  # data pointers of the program's weights

    @classmethod
    def of(cls, step_ctx, kv_pool, state_pool, weights) -> "StepFacts":
        kv = {lid: sum(t[0, 0].nbytes for t in entries.values()) for lid, entries in kv_pool.buffers.items()}
        st = {lid: {name: t[0].nbytes for name, t in entries.items()} for lid, entries in state_pool.buffers.items()}
        return cls(list(step_ctx.query_lens), list(step_ctx.cache_lens), kv, st, {w.data_ptr() for w in weights})


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _moved(args, out, facts: StepFacts) -> dict:
    """Bytes of the distinct tensors a node reads (weights apart) and writes."""
    seen, weights, acts = set(), 0, 0
    for t in _tensors(args):
        key = (t.data_ptr(), t.nbytes)
        if key in seen:
            continue
        seen.add(key)
        if t.data_ptr() in facts.weight_ptrs:
            weights += t.nbytes
        else:
            acts += t.nbytes
    written = sum(t.nbytes for t in _tensors([out]) if (t.data_ptr(), t.nbytes) not in seen)
    return cost(weights=weights, activations=acts + written)


def node_cost(node, what: str, args, out, facts: StepFacts) -> dict:
    """The cost of one labelled node, from its concrete arguments (account_cost.py says what counts)."""
    op = _op_of(node)
    if op is not None:
        return op_cost(op, dict(zip(op_arguments(op), args)), facts)
    name = _aten_name(node.target)
    if name in FREE or (isinstance(out, torch.Tensor) and any(out is a for a in args)):
        return cost()
    if name in GEMMS:
        a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
        k = a.shape[-1]
        n = b.shape[0] if name == "linear" else b.shape[-1]
        flops = 2 * (a.numel() // k) * n * k  # every row of a (every batch of a bmm) times n columns
        moved = _moved(args, out, facts)
        moved["flops"] = float(flops)
        return moved
    if name == "embedding":
        rows = out.nbytes  # the rows gathered, read once and written once
        return cost(weights=rows, activations=rows + args[1].nbytes)
    moved = _moved(args, out, facts)
    return cost(weights=moved["weights"], unfused=moved["activations"])


def op_cost(op: str, a: dict, facts: StepFacts) -> dict:
    """An hgc op node's cost from its named arguments (compiler/splitops/ops.py's schemas)."""
    q_lens, c_lens = facts.query_lens, facts.cache_lens
    tokens_bytes = sum(t.nbytes for name, t in a.items() if isinstance(t, torch.Tensor) and name in
                       ("q", "k", "v", "g", "beta", "out", "q_latent", "q_rope", "kv_latent", "k_rope", "x"))
    layer = a.get("layer_id")
    if op == "gqa_attention":
        q, k, v = a["q"], a["k"], a["v"]
        return attention_cost(q_lens, c_lens, q.shape[1], q.shape[-1], v.shape[-1], facts.kv_bytes_per_token[layer],
                              tokens_bytes)
    if op == "mla_attention":
        ql, qr = a["q_latent"], a["q_rope"]
        return attention_cost(q_lens, c_lens, ql.shape[1], ql.shape[-1] + qr.shape[-1], ql.shape[-1],
                              facts.kv_bytes_per_token[layer], tokens_bytes)
    if op in CORE_KIND:
        q, v = a["q"], a["v"]
        state = sum(b for name, b in facts.state_bytes[layer].items() if name != "conv")
        return linear_core_cost(CORE_KIND[op], q_lens, v.shape[1], q.shape[-1], v.shape[-1], state, tokens_bytes)
    if op == "short_conv":
        x, w = a["x"], a["weight"]
        weight_bytes = w.nbytes + (a["bias"].nbytes if a.get("bias") is not None else 0)
        return short_conv_cost(x.shape[0], x.shape[1], w.shape[-1], len(q_lens), facts.state_bytes[layer]["conv"],
                               weight_bytes, tokens_bytes)
    if op == "gdn_fused":  # the conv and the core, their intermediates kept inside the op
        qkv, z, w = a["qkv"], a["z"], a["conv_weight"]
        v_heads, v_dim = z.shape[1], z.shape[2]
        k_dim = (qkv.shape[1] - v_heads * v_dim) // (2 * int(a["k_heads"]))
        fused_bytes = sum(a[name].nbytes for name in ("qkv", "z", "b", "a", "out", "A_log", "dt_bias", "norm_weight"))
        state = sum(b for name, b in facts.state_bytes[layer].items() if name != "conv")
        conv = short_conv_cost(qkv.shape[0], qkv.shape[1], w.shape[-1], len(q_lens), facts.state_bytes[layer]["conv"],
                               w.nbytes, 0)
        return add_costs(conv, linear_core_cost("gdn", q_lens, v_heads, k_dim, v_dim, state, fused_bytes))
    if op == "moe":
        x, w13 = a["x"], a["w13"]
        shared = a["shared_w2"].shape[-1] if a.get("shared_w2") is not None else 0
        return moe_cost(x.shape[0], x.shape[1], w13.shape[1] // 2, w13.shape[0], int(a["top_k"]), w13.element_size(),
                        x.element_size(), shared, a.get("shared_gate") is not None)
    return cost(activations=tokens_bytes)  # collectives: the tensors they move


class _Labelled(torch.fx.Interpreter):
    """One piece run node by node: each labelled node inside its profiler range, its cost added up."""

    def __init__(self, gm, labels: dict, costs: dict | None, facts: StepFacts | None):
        super().__init__(gm, garbage_collect_values=True)
        self.labels, self.costs, self.facts = labels, costs, facts

    def run_node(self, n):
        label = self.labels.get(n)
        if label is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        with record_function(LABEL + "|".join(label)):
            out = getattr(self, n.op)(n.target, args, kwargs)
        if self.costs is not None:
            here = node_cost(n, label[1], args, out, self.facts)
            self.costs[label] = add_costs(self.costs.get(label, {}), here)
        return out


@contextlib.contextmanager
def labelled(module, labels: dict, costs: dict | None = None, facts: StepFacts | None = None):
    """For the block, every piece of `module` (and `module` itself) holding labelled nodes runs through
    `_Labelled`; costs (if a dict is given) gather per label. The pieces' own forwards come back on exit."""
    patched = []
    for sub in [module, *module.modules()]:
        if isinstance(sub, torch.fx.GraphModule) and "forward" not in sub.__dict__ and \
                any(n in labels for n in sub.graph.nodes):
            sub.forward = types.MethodType(lambda self, *args: _Labelled(self, labels, costs, facts).run(*args), sub)
            patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward


def split_compiled(kernels: list[dict]) -> None:
    """In place: a GEMM kernel inside a compiled glue call takes the segment's GEMM label."""
    for k in kernels:
        if k["label"] and k["label"][1] == COMPILED_GLUE and GEMM_KERNEL.search(k["name"]):
            k["label"] = (k["label"][0], COMPILED_GEMM)


def _label_of(event) -> tuple[str, str] | None:
    while event is not None:
        if event.name.startswith(LABEL):
            layer, what = event.name[len(LABEL):].split("|", 1)
            return layer, what
        event = event.cpu_parent
    return None


def _spans(events) -> list:
    """(start, end, name) of the label ranges among `events`, the shortest first."""
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in events if e.name.startswith(LABEL)),
                  key=lambda s: s[1] - s[0])


def _innermost(spans, t: float):
    """The label of the shortest span (start, end, name) that holds time t, or None."""
    name = next((n for a, b, n in spans if a <= t <= b), None)
    return tuple(name[len(LABEL):].split("|", 1)) if name else None


def profile_kernels(fn, cuda: bool, calls: int = 1) -> list[list[dict]]:
    """fn() `calls` times under torch.profiler: per call, its kernels in the order they ran,
    {"name", "us", "label", "via"} (label None outside every range; via: how it was found). CPU: the
    leaf CPU ops of the calls, labelled by their parents.
    A kernel belongs to the call whose host range (the device synchronised inside it) holds its start."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(calls):
            with record_function(f"{CALL}{i}"):
                fn()
                if cuda:
                    torch.cuda.synchronize()
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CPU and e.name.startswith(CALL))
    if cuda:
        # A kernel's range: by its link to the torch op that launched it (torch >= 2.12 keeps the
        # link on the event; the op's parents lead to the range), else by the range's span on the
        # device timeline (the profiler draws each range there too, around the kernels it launched).
        hosts = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        on_device = _spans(e for e in events if e.device_type == DeviceType.CUDA)

        def kernel_label(e):
            linked = getattr(e, "linked_correlation_id", 0)
            found = _label_of(hosts.get(linked)) if linked else None
            return (found, "link") if found else (_innermost(on_device, e.time_range.start), "device span")

        kernels = [(e, *kernel_label(e)) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith((LABEL, CALL))]
    else:
        kernels = [(e, _label_of(e.cpu_parent), "parents") for e in events
                   if e.device_type == DeviceType.CPU and not e.cpu_children
                   and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith((LABEL, CALL, "ProfilerStep"))]
    kernels.sort(key=lambda found: found[0].time_range.start)
    per: list[list[dict]] = [[] for _ in spans]
    for e, label, via in kernels:
        call = next((i for i, (a, b) in enumerate(spans) if a <= e.time_range.start <= b), None)
        if call is not None:
            per[call].append({"name": e.name, "us": e.time_range.elapsed_us(), "label": label,
                              "via": via if label else None})
    return per


def per_call(calls: list[list[dict]]) -> tuple[list[dict], str]:
    """Several calls' kernels as one call's: each position's mean time where every call launched the
    same kernels (a replayed graph does); else the last call's alone, and a note saying so (the
    CPU reference's MoE launches by the experts each call hits)."""
    last = calls[-1]
    if any([k["name"] for k in run] != [k["name"] for k in last] for run in calls):
        return last, f"the last of {len(calls)} calls (their kernel sequences differ)"
    mean = [{"name": k["name"], "us": statistics.mean(run[i]["us"] for run in calls), "label": k["label"]}
            for i, k in enumerate(last)]
    return mean, f"mean over {len(calls)} calls"


def align(timed: list[dict], eager: list[dict]) -> dict:
    """Give each timed kernel the label of its twin in the labelled eager run (difflib over the
    kernel names; a replaced block of equal length pairs by position). Returns counts."""
    a, b = [k["name"] for k in eager], [k["name"] for k in timed]
    matched = by_position = 0
    for k in timed:
        k["label"] = UNMATCHED
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for i, j in zip(range(i1, i2), range(j1, j2)):
                timed[j]["label"] = eager[i]["label"] or UNMATCHED
            matched += (i2 - i1) if tag == "equal" else 0
            by_position += (i2 - i1) if tag == "replace" else 0
    return {"kernels": len(timed), "eager_kernels": len(eager),
            "eager_labelled": {via: sum(k.get("via") == via for k in eager) for via in {k.get("via") for k in eager}},
            "matched_by_name": matched,
            "matched_by_position": by_position, "unmatched": len(timed) - matched - by_position}



TIMELINE_GAP_US = 5.0  # device idle spans at least this long are listed one by one
TIMELINE_GAPS = 12     # the longest ones
TIMELINE_REPS = 5


# Where a synchronising call is reported: the innermost frame of the project's own code under it
# (a warning's own location is the torch function that synchronised, which says nothing).
PROJECT_DIRS = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("runtime", "compiler", "models"))


def _sync_sites(fn) -> list[str]:
    """Where fn() synchronises the host with the device: torch's sync debug mode warns at every
    synchronising call (a .item(), a copy from pageable memory, ...); each site (the innermost
    frame of runtime/, compiler/ or models/ under it) once, with its count."""
    import traceback
    import warnings

    sites: dict = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PROJECT_DIRS)]
        site = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{site} (x{n})" for site, n in sites.items()]


def timeline(fn, cuda: bool, trace_path=None, phases=None, stacks: bool = False) -> dict:
    """Where one call's wall time goes that its kernels' times do not account for.

    - host against device: per call (median of TIMELINE_REPS), the host's time until fn returns and the
      device's time from an event before it to one after it; a device time close to the host's
      says the device waited on the host;
    - phases: {name: callable} timed alone on the host the same way (the runner's staging, its plan);
    - syncs: the lines where fn() synchronised the host with the device (torch's sync debug mode);
    - under torch.profiler (the last of three calls, the first two warming CUPTI up): the device's
      busy time (the union of its kernels and copies), its idle time before the first kernel,
      between kernels and after the last, the longest idle spans with the kernels on either side and
      the host ops during them; and the Chrome trace at trace_path (gzip if it ends in .gz), with
      each op's Python stack where `stacks` (a larger trace: where a gap's host time goes);
    - the launches through runtime/backends/kernels/launch_cache.Launcher per call, and how many of
      them missed its cache (Triton's whole launch path: new arguments, a new buffer's address).
    CPU: an empty record."""
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        fn()
        return {}
    from runtime.backends.kernels.launch_cache import Launcher

    host, device_ms = [], []
    hits0, misses0 = Launcher.totals()
    for _ in range(TIMELINE_REPS):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        device_ms.append(a.elapsed_time(b))
    hits1, misses1 = Launcher.totals()
    phase_us = {}
    for name, phase in (phases or {}).items():
        runs = []
        for _ in range(TIMELINE_REPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            phase()
            runs.append((time.perf_counter() - t0) * 1e6)
        phase_us[name] = statistics.median(runs)
    torch.cuda.synchronize()
    syncs = _sync_sites(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof:
        for i in range(3):
            with record_function(f"{CALL}{i}"):
                fn()
                torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    events = prof.events()
    call = max((e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(CALL)),
               key=lambda e: e.time_range.start)
    t0, t1 = call.time_range.start, call.time_range.end
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA
                     and not getattr(e, "is_user_annotation", False) and not e.name.startswith((LABEL, CALL))
                     and t0 <= e.time_range.start <= t1), key=lambda e: e.time_range.start)
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.name.startswith(CALL)
                and t0 <= e.time_range.start <= t1]
    busy, gaps, end, before = 0.0, [], t0, None
    for e in device:
        a, b = e.time_range.start, e.time_range.end
        if a > end:
            gaps.append((a - end, end, before, e.name))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, before = b, e.name
    if t1 > end:
        gaps.append((t1 - end, end, before, None))

    def during(a, b):
        inside = [h for h in host_ops if h.time_range.start < b and h.time_range.end > a and not h.cpu_children]
        names: dict = {}
        for h in inside:
            names[h.name] = names.get(h.name, 0.0) + min(b, h.time_range.end) - max(a, h.time_range.start)
        return {k[:80]: round(v, 1) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:5]}

    listed = sorted((g for g in gaps if g[0] >= TIMELINE_GAP_US), key=lambda g: -g[0])[:TIMELINE_GAPS]
    return {"host_call_us": statistics.median(host), "device_call_us": statistics.median(device_ms) * 1e3,
            "phases_us": phase_us, "syncs": syncs,
            "launcher_launches": (hits1 - hits0 + misses1 - misses0) / TIMELINE_REPS,
            "launcher_misses": (misses1 - misses0) / TIMELINE_REPS,
            "profiled_wall_us": t1 - t0, "device_busy_us": busy, "device_idle_us": (t1 - t0) - busy,
            "idle_before_first_us": (device[0].time_range.start - t0) if device else t1 - t0,
            "idle_after_last_us": t1 - end, "device_events": len(device),
            "gaps_at_least_us": TIMELINE_GAP_US, "gaps_count": sum(g[0] >= TIMELINE_GAP_US for g in gaps),
            "gaps_sum_us": sum(g[0] for g in gaps if g[0] >= TIMELINE_GAP_US),
            "longest_gaps": [{"us": round(g[0], 1), "at_us": round(g[1] - t0, 1), "after": (g[2] or "")[:60],
                              "before": (g[3] or "")[:60], "host": during(g[1], g[1] + g[0])} for g in listed]}
