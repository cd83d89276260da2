"""SplitPass: one order-preserving partition of each program per forward mode, recorded as data.

For each mode (decode, extend, mixed, target_verify):

1. an op node is a split point when its op's declared capture policy for that mode is "eager", OR
   the backend routing bound it to does not declare that mode capturable for that op with the node's
   kernel options (its capability's `capturable`: `modes_capturable`, or an `op_capture` entry): whether a node is captured is decided here, once, from both, and the
   runtime reads the decision from split.json (it derives it nowhere else);
2. walking the graph in order, maximal runs of split points become eager pieces (adjacent eager
   ops merge into one gap) and maximal runs of everything else become captured pieces;
3. a plan with gaps records the most tokens of a step at which every gap op may still be captured
   (`whole_up_to`: a backend that captures an op only in steps of up to some tokens, an `op_capture`
   entry bounded by a kernel option, keeps the node a gap here and names the bound; 0: some gap op
   is never captured), and what sets it: a step of at most that many tokens may be one whole-step
   graph, gaps included (the graph runner's extend keys);
4. the plan (`SplitPlan`: ordered pieces, each "captured" or "eager" with its node names) goes to
   ctx.split_plans[program][mode] and each node gets node.meta["hgc.piece"][mode] = piece index.

Only op cores land in gaps: projections, norms, gates and the `out` allocations stay in the
captured pieces around them, so each run of glue between op cores (compiler/splitops/glue.py, what
a target bundle compiles) lies whole in one captured piece of every plan; `ensures` checks it. The plan is data (split.json); the runtime re-applies it with
`compiler.splitops.artifact.apply_split_plan` (split_module with keep_original_order=True), so
the pass itself leaves the graph untouched.

Example (a GDN layer then a full layer) in extend mode, with the GDN layer's ops on a backend that
captures them there (triton_linear, chunk_impl=triton) and attention eager by its policy:

    captured[embedding .. short_conv .. gdn_core .. linear] eager[gqa_attention] captured[..] ...

(with chunk_impl=fla: ... eager[gdn_core] ... as well; the short conv stays captured)

and in decode mode, where every op may be captured: one captured piece holding the whole graph
(unless a node is routed to a backend that cannot be captured in decode: then its node is a gap).
"""

from __future__ import annotations

from compiler.passes.base import CompilePass, PassResult, PostconditionError, PreconditionError
from compiler.splitops import MODES, Capture, Mode, is_op_node, op_name_of, op_spec
from compiler.splitops.artifact import CAPTURED, EAGER, Piece, SplitPlan, plan_node_names
from compiler.splitops.glue import GlueSplitError, glue_segments, segment_pieces

__all__ = ["SplitPass", "plan_for_mode", "is_split_point", "gap_capture_tokens"]


def is_split_point(node, mode: Mode, capabilities=None) -> bool:
    """An op node that runs eagerly in `mode`: its op's policy says eager, or (given the capability
    table) the backend routing bound it to cannot capture that op, with the node's kernel options, in that mode."""
    if not is_op_node(node):
        return False
    if op_spec(op_name_of(node.target)).capture(mode) is Capture.EAGER:
        return True
    backend = node.meta.get("hgc.backend")
    if capabilities is None or backend is None:
        return False
    return not capabilities[backend].capturable(op_name_of(node.target), mode, node.meta.get("hgc.backend_options"))


def gap_capture_tokens(node, mode: Mode, capabilities=None) -> tuple[int, str]:
    """For a split point: the most tokens of a `mode` step in which its backend may still capture it
    (a whole-step graph holds the gap too; 0: never), and what sets that, for split.json."""
    op = op_name_of(node.target)
    backend = node.meta.get("hgc.backend")
    if op_spec(op).capture(mode) is Capture.EAGER:
        return 0, f"hgc.{op} is eager in {mode.value} by its op policy"
    if capabilities is None or backend is None:
        return 0, f"hgc.{op} has no backend"
    cap = capabilities[backend]
    options = cap.resolve_options(node.meta.get("hgc.backend_options") or {})
    tokens = cap.capture_tokens(op, mode, options) or 0
    if not tokens:
        return 0, f"hgc.{op} on {backend} cannot be captured in {mode.value}"
    bound = ", ".join(dict.fromkeys(f"{e.up_to}={options[e.up_to]}" for e in cap.op_capture
                                    if e.up_to and e.applies(op, mode, options)))
    return tokens, f"hgc.{op} on {backend} ({bound})"


def whole_bound(gm, pieces, mode: Mode, capabilities=None) -> tuple[int, str]:
    """A plan's `whole_up_to` and `whole_why`: the smallest bound of its gap ops, and what sets it."""
    by_name = {n.name: n for n in gm.graph.nodes}
    found = [gap_capture_tokens(by_name[name], mode, capabilities) for p in pieces if p.kind == EAGER
             for name in p.nodes]
    if not found:
        return 0, ""
    limit = min(t for t, _ in found)
    return limit, "; ".join(dict.fromkeys(why for t, why in found if t == limit))


def plan_for_mode(gm, mode: Mode, capabilities=None) -> SplitPlan:
    pieces: list[Piece] = []
    run: list[str] = []
    run_kind = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        kind = EAGER if is_split_point(node, mode, capabilities) else CAPTURED
        if kind != run_kind and run:
            pieces.append(Piece(len(pieces), run_kind, tuple(run)))
            run = []
        run_kind = kind
        run.append(node.name)
    if run:
        pieces.append(Piece(len(pieces), run_kind, tuple(run)))
    return SplitPlan(mode, tuple(pieces), *whole_bound(gm, pieces, mode, capabilities))


class SplitPass(CompilePass):
    name = "split"
    version = 2

    def config(self) -> dict:
        return {"modes": [m.value for m in MODES]}

    def requires(self, gm, ctx) -> None:
        unrouted = [n.name for n in gm.graph.nodes if is_op_node(n) and "hgc.backend" not in n.meta]
        if unrouted:
            raise PreconditionError(f"split: op nodes {unrouted[:3]} have no backend; the routing pass must run first")

    def __call__(self, gm, ctx) -> PassResult:
        plans = {mode: plan_for_mode(gm, mode, ctx.capabilities) for mode in MODES}
        ctx.split_plans[ctx.program] = plans
        by_name = {n.name: n for n in gm.graph.nodes}
        for mode, plan in plans.items():
            for piece in plan.pieces:
                for name in piece.nodes:
                    by_name[name].meta.setdefault("hgc.piece", {})[mode.value] = piece.index
        return PassResult(gm, modified=False)

    def ensures(self, gm, ctx) -> None:
        names = plan_node_names(gm)
        by_name = {n.name: n for n in gm.graph.nodes}
        segments = glue_segments(gm)
        for mode, plan in ctx.split_plans[ctx.program].items():
            planned = [n for p in plan.pieces for n in p.nodes]
            if planned != names:
                raise PostconditionError(f"split: plan {mode.value} does not list the graph's nodes once each, in order")
            for a, b in zip(plan.pieces, plan.pieces[1:]):
                if a.kind == b.kind:
                    raise PostconditionError(f"split: plan {mode.value}: pieces {a.index} and {b.index} are both "
                                             f"{a.kind} (adjacent pieces must merge)")
            for piece in plan.pieces:
                if piece.kind == EAGER:
                    strays = [n for n in piece.nodes if not is_split_point(by_name[n], mode, ctx.capabilities)]
                    if strays:
                        raise PostconditionError(f"split: plan {mode.value}: eager piece {piece.index} holds "
                                                 f"non-op-core nodes {strays[:3]}")
            try:
                segment_pieces(segments, plan, ctx.program)
            except GlueSplitError as e:
                raise PostconditionError(f"split: {e}") from None
