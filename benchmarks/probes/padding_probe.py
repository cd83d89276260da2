"""Padded against unpadded, layer by layer: where padding a step changes how a real request is computed.

On the GPU machine (one call, all four families at the bench size; see benchmarks/gpu_call.sh):

    python3 benchmarks/probes/padding_probe.py --out $OUT
    python3 benchmarks/probes/padding_probe.py --device cpu --size tiny --out /tmp/probe   # CPU reference backend

Per family (stages skippable with --skip):
1. init_compile: `hgc init-model`, `hgc compile` (--target cuda --dtype bfloat16 on the GPU).
2. load: the artifact, pools, the target's backend, a GraphRunner.
3. probe: prompts of 5, 17, 40 and 64 tokens prefilled in one extend step three times, eagerly,
   from the same caches: padded to the graph key that serves such a step (256 rows, 16
   requests), unpadded, and unpadded with each op on the padded run's inputs (TeacherForcing, as
   the start-up parity check runs it). Per op call: the relative error of the real rows of each
   per-token input and of the output, padded against unpadded; the first op whose inputs agree and
   whose output does not computes differently when padded, the first op whose inputs differ while
   every earlier output agreed points at the glue between ops; and, on the same inputs, the op's
   error and the glue's. For each moe call: the experts each real token went to in either run (the
   routing backend's own router, on the rows that run handed it), the tokens whose choice flipped,
   and for those the gap between the last chosen and the first unchosen biased score (float64,
   from the unpadded input). Then the logits, the states and KV written for the real requests, and
   whether the padding slot and unowned pages stayed as they were.
   probe_fp32_reduction: the same with cuBLAS's bf16 reduction of split-K partial sums turned off.
4. glue_gemms: for each weight shape of the model, whether a matrix product gives the first 126
   rows the same bits when it has 126 rows as when it has 256, and its time at either size
   (CUBLAS_WORKSPACE_CONFIG, if set, recorded: `:0:0` leaves cuBLAS no workspace for split-K).
5. parity: a runner with a decode and an extend bucket captured (CUDA graphs; CPU: reruns), then
   the start-up parity check (runtime/graphs/startup_parity.py): passed, or its refusal.
6. tokens: greedy tokens of --num-prompts prompts x --new-tokens, every step eager and unpadded,
   against a runner whose graphs pad them: "light" (the prefill in the smallest extend bucket
   that holds it, decode in a bucket of the batch) and "heavy" (an extend bucket twice that, a
   decode bucket of twice the batch); per step until the first difference the logits' relative
   error, and the eager top-2 gap there.
JSON to OUT/padding_probe.json after every stage; a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

import torch  # noqa: E402

from bench_common import (Stages, compare, decode_batch, key_names, logit_drift, prompts_for, run_guarded,  # noqa: E402
                          synchronizer, time_ms)
from hgc import main as hgc  # noqa: E402
from runtime.backends.cpu_reference import route_topk  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.step.bound_ops import BoundOps  # noqa: E402
from runtime.engine.generate import make_pools  # noqa: E402
from runtime.graphs.runner import GraphRunner, ParityError  # noqa: E402
from runtime.graphs.startup_parity import release_items  # noqa: E402
from runtime.artifact.loader import load_artifact  # noqa: E402
from runtime.graphs.parity import CacheWatch, OpTrace, TeacherForcing, op_arg_positions, rel_err, rtol_for  # noqa: E402
from testkit.graph_cases import greedy  # noqa: E402

PAGE = 16
PROBE_LENS = (5, 17, 40, 64)  # 126 tokens: the prefill of gpu_e2e's token check
PAD_TOKENS, PAD_SEQS = 256, 16  # the extend key that serves it


class MoECalls:
    """An observer beside OpTrace: each moe call's whole arguments (every row, padding included), so
    its routing can be recomputed on exactly what the op was handed."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, name: str, args: tuple) -> None:
        if name == "moe":
            self.calls.append(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))


def both(*observers):
    def observe(name, args):
        for o in observers:
            o(name, args)
    return observe


def routed_experts(backend, args: tuple, n_real: int) -> torch.Tensor:
    """[n_real, top_k] expert ids as the moe op's owner routes them (sorted per token)."""
    at = op_arg_positions("moe")
    get = lambda name: args[at[name]]  # noqa: E731
    route_args = (get("x"), get("router_weight"), get("router_bias"), get("top_k"), get("scoring"),
                  get("renormalize"), get("routed_scale"), get("num_groups"), get("topk_groups"))
    owner = backend.owner_of("moe") if hasattr(backend, "owner_of") else backend
    if type(owner).__name__ == "TritonMoEBackend":
        from runtime.backends.kernels.moe import route
        ids, _ = route(*route_args, n_real=n_real)
    else:
        ids, _ = route_topk(*route_args)
    return ids[:n_real, : get("top_k")].long().sort(-1).values.cpu()


def choice_gaps(args: tuple, rows: torch.Tensor) -> list[dict]:
    """For the given token rows: the float64 gap between the k-th and (k+1)-th biased score among the
    experts its groups allow, and between the last kept and first dropped group score."""
    at = op_arg_positions("moe")
    x, w, bias = args[at["x"]], args[at["router_weight"]], args[at["router_bias"]]
    k, scoring, G, keep = args[at["top_k"]], args[at["scoring"]], args[at["num_groups"]], args[at["topk_groups"]]
    logits = x[rows].double() @ w.double().t()
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores + (bias.double() if bias is not None else 0)
    out = []
    for r, c in zip(rows.tolist(), choice):
        entry = {"row": r}
        if G > 1:
            gs = c.view(G, -1).topk(min(2, c.numel() // G), -1).values.sum(-1).sort(descending=True).values
            entry["group_gap"] = float(gs[keep - 1] - gs[keep])
            kept = gs[keep - 1]
            mask = c.view(G, -1).topk(min(2, c.numel() // G), -1).values.sum(-1) >= kept
            c = c.view(G, -1).masked_fill(~mask[:, None], float("-inf")).flatten()
        top = c.sort(descending=True).values
        entry["expert_gap"] = float(top[k - 1] - top[k])
        out.append(entry)
    return out


def probe(runner: GraphRunner, backend, items, pad_tokens: int, pad_seqs: int) -> dict:
    """The layer-by-layer comparison of one step of `items`, padded to (pad_tokens, pad_seqs) and not."""
    st, kv = runner.state_pool, runner.kv_pool
    plain = build_step(items, kv, "cpu", max_pages=runner.max_pages)
    padded = build_step(items, kv, "cpu", mode=plain.ctx.mode, pad_tokens_to=pad_tokens, pad_seqs_to=pad_seqs,
                        max_pages=runner.max_pages)
    n = plain.ctx.num_real_tokens
    watch = CacheWatch(kv, st, [s.slot for s, _ in items], [p for s, _ in items for p in s.pages])
    runs = {}
    for name, step in (("padded", padded), ("unpadded", plain), ("forced", plain)):
        trace, moe = OpTrace(n, inputs=True), MoECalls()
        runner.ops.observer = both(trace, moe)
        # "forced": unpadded, each op on the padded run's inputs (what the parity check does)
        forced = TeacherForcing(runs["padded"]["trace"]) if name == "forced" else None
        runner.ops.intercept = forced
        try:
            logits = runner.run(step, None).float().cpu()
        finally:
            runner.ops.observer = runner.ops.intercept = None
        runs[name] = dict(trace=trace.records, moe=moe.calls, logits=logits, written=watch.written(),
                          outside=watch.touched_outside(), forced=forced)
        watch.restore()
    a, b, f = runs["unpadded"], runs["padded"], runs["forced"]
    rtol = rtol_for(a["trace"][0].out.dtype)
    ops, first_op, first_input = [], None, None
    for i, (ra, rb) in enumerate(zip(a["trace"], b["trace"])):
        in_err = {k: rel_err(rb.inputs[k], v) for k, v in ra.inputs.items()}
        out_err = rel_err(rb.out, ra.out)
        ops.append({"call": i, "layer": ra.layer, "op": ra.op, "out_rel_err": out_err,
                    "input_rel_err": {k: float(f"{v:.3e}") for k, v in in_err.items()},
                    "forced_op_rel_err": f["forced"].ops[i], "forced_glue_rel_err": f["forced"].glue[i]})
        if first_input is None and max(in_err.values(), default=0.0) > 0:
            first_input = ops[-1]
        if first_op is None and out_err > 0 and max(in_err.values(), default=0.0) == 0:
            first_op = ops[-1]
    moe = []
    for ca, cb in zip(a["moe"], b["moe"]):
        at = op_arg_positions("moe")
        ids_a, ids_b = routed_experts(backend, ca, n), routed_experts(backend, cb, n)
        flipped = (ids_a != ids_b).any(-1).nonzero().flatten()
        entry = {"layer": int(ca[at["layer_id"]]), "x_rel_err": rel_err(cb[at["x"]][:n], ca[at["x"]][:n]),
                 "tokens": n, "flipped_tokens": int(flipped.numel())}
        if flipped.numel():
            entry["flips"] = [{**g, "unpadded": ids_a[g["row"]].tolist(), "padded": ids_b[g["row"]].tolist()}
                              for g in choice_gaps(ca, flipped[:8])]
        moe.append(entry)
    return {"rtol": rtol, "mode": plain.ctx.mode.value, "real_rows": n, "real_requests": len(items),
            "pad_tokens": pad_tokens, "pad_seqs": pad_seqs,
            "logits_rel_err": rel_err(b["logits"], a["logits"]),
            "first_op_computing_differently": first_op, "first_op_handed_different_inputs": first_input,
            "written_difference": watch.differences(b["written"], a["written"], 0.0),
            "forced": {"max_op_rel_err": max(f["forced"].ops), "max_glue_rel_err": max(f["forced"].glue),
                       "logits_rel_err": rel_err(f["logits"], b["logits"]),
                       "first_beyond_rtol": f["forced"].first_beyond(rtol),
                       "written_beyond_rtol": watch.differences(b["written"], f["written"], rtol)},
            "touched_outside": {k: runs[k]["outside"] for k in runs}, "moe": moe, "ops": ops}


def run_family(family: str, args, work: Path, rec: dict, save) -> None:
    dev = torch.device(args.device)
    stage = Stages(rec.setdefault("stages", {}), skip=args.skip, save=save)
    ckpt, art_dir = work / f"ckpt_{family}_{args.size}", work / f"art_{family}_{args.size}"
    prompt_lens = [PROBE_LENS[i % len(PROBE_LENS)] for i in range(args.num_prompts)]
    max_len = -(-(max(PROBE_LENS) + args.new_tokens) // PAGE) * PAGE
    # The token check's graphs: the smallest extend bucket that holds the prefill, with twice the
    # requests (padded requests too); "heavy": twice that bucket, and a decode bucket of twice the batch.
    extend_tokens = max(PAD_TOKENS, 1 << (sum(prompt_lens) - 1).bit_length())
    extend_seqs = 2 * args.num_prompts
    token_checks = {"light": ((args.num_prompts,), (extend_tokens,)),
                    "heavy": ((2 * args.num_prompts,), (2 * extend_tokens,))}
    ctx: dict = {}

    def init_compile():
        if args.reuse and (art_dir / "manifest.json").is_file():
            print(f"  reusing {art_dir}", flush=True)
            return
        if hgc(["init-model", "--family", family, "--size", args.size, "--seed", "0", "-o", str(ckpt), "--force"]):
            raise RuntimeError("init-model failed")
        target = ["--target", "cuda", "--dtype", "bfloat16"] if dev.type == "cuda" else []
        if hgc(["compile", str(ckpt), "-o", str(art_dir), "--no-dumps", "--force", "--no-inductor", *target]):
            raise RuntimeError("compile failed")
    stage("init_compile", init_compile)

    def runner_for(art, decode, extend, seqs):
        kv, st = make_pools(art.registry, max_len, 2 * extend_seqs + 8, page_size=PAGE, device=dev,
                            kv_dtype=torch.bfloat16 if dev.type == "cuda" else None)
        graphs = None
        if dev.type != "cuda":
            from testkit.graph_cases import RerunGraphs
            graphs = RerunGraphs()
        ops = BoundOps(art.backends(kv, st).for_program("main"))  # the backends routing.json names
        return GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=decode, extend_buckets=extend,
                           max_pages_per_seq=max_len // PAGE, extend_max_seqs=seqs, graphs=graphs)

    def load():
        from models.loader import load_config
        art = load_artifact(art_dir, dev)
        ctx.update(art=art, vocab=int(load_config(ckpt)[2]["vocab_size"]))
        ctx["runner"] = runner_for(art, (), (), PAD_SEQS)  # eager steps only
        rec["backend"] = ctx["runner"].backend.name
    stage("load", load, needs=["init_compile"])

    def report(p):
        first, handed = p["first_op_computing_differently"], p["first_op_handed_different_inputs"]
        print(f"  {p['mode']}, {p['real_requests']} requests / {p['real_rows']} rows padded to {p['pad_seqs']} / "
              f"{p['pad_tokens']}: logits rel err {p['logits_rel_err']:.3g}; first op computing differently: "
              f"{first and (first['layer'], first['op'], first['out_rel_err'])}; first op handed different inputs: "
              f"{handed and (handed['layer'], handed['op'])}; written: {p['written_difference']}; outside: "
              f"{p['touched_outside']}", flush=True)
        for m in p["moe"]:
            print(f"  moe layer {m['layer']}: x rel err {m['x_rel_err']:.3g}, {m['flipped_tokens']} of {m['tokens']} "
                  f"tokens routed differently {[(f['row'], f['expert_gap']) for f in m.get('flips', [])][:4]}",
                  flush=True)
        print(f"  unpadded with each op on the padded run's inputs: {p['forced']}", flush=True)
        for o in p["ops"][:40]:
            print(f"    {o['call']:3d} layer {o['layer']:2d} {o['op']:15s} out {o['out_rel_err']:.3e} in "
                  f"{o['input_rel_err']}; same inputs: op {o['forced_op_rel_err']:.2e} glue "
                  f"{o['forced_glue_rel_err']:.2e}", flush=True)

    def run_probe(key="probe"):
        runner, st = ctx["runner"], ctx["runner"].state_pool
        items = [(SeqState(st.alloc()), p) for p in prompts_for(ctx["vocab"], PROBE_LENS, seed=11)]
        try:
            rec[key] = probe(runner, runner.backend, items, PAD_TOKENS, PAD_SEQS)
        finally:
            release_items(runner, items)
        report(rec[key])
        # The next decode step of a batch with a history, padded to a bucket of twice its requests.
        with decode_batch(runner, st, args.num_prompts, ctx["vocab"], torch.Generator().manual_seed(12)) as items:
            rec[key + "_decode"] = probe(runner, runner.backend, items, 2 * len(items), 2 * len(items))
        report(rec[key + "_decode"])
    stage("probe", run_probe, needs=["load"])

    def probe_fp32_reduction():
        """The same probe with cuBLAS's reduced-precision (bf16) reduction of split-K partial sums off."""
        flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            run_probe("probe_fp32_reduction")
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    stage("probe_fp32_reduction", probe_fp32_reduction, needs=["load"])

    def glue_gemms():
        """Whether a matrix product of the model's weight shapes gives a row the same bits at 126 rows
        as at 256 (what the pieces between ops compute: cuBLAS picks a kernel by the row count)."""
        g = torch.Generator(device=dev).manual_seed(0)
        n = sum(PROBE_LENS)
        shapes, out = {}, []
        for name, w in ctx["art"].weights.items():
            if w.dim() == 2 and w.is_floating_point():
                shapes.setdefault(tuple(w.shape), name)
        for shape, name in sorted(shapes.items()):
            w = ctx["art"].weights[name].to(dev)
            x = torch.randn(PAD_TOKENS, shape[1], generator=g, device=dev).to(w.dtype)
            full, part = torch.nn.functional.linear(x, w)[:n], torch.nn.functional.linear(x[:n], w)
            out.append({"weight": name, "shape": list(shape), "identical": bool(torch.equal(full, part)),
                        "rel_err": rel_err(part, full),
                        "ms_rows": {str(m): time_ms(lambda m=m: torch.nn.functional.linear(x[:m], w), dev, 20)
                                    for m in (n, PAD_TOKENS)}})
        rec["glue_gemms"] = out
        rec["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        for o in out:
            verdict = "identical" if o["identical"] else f"rel err {o['rel_err']:.2e}"
            print(f"  {o['shape']} ({o['weight']}): {verdict}; ms at {n} / {PAD_TOKENS} rows "
                  f"{', '.join(f'{v:.4f}' for v in o['ms_rows'].values())}", flush=True)
    stage("glue_gemms", glue_gemms, needs=["load"])

    def parity():
        runner = runner_for(ctx["art"], (4,), (PAD_TOKENS,), PAD_SEQS)
        try:
            rec["parity"] = {"passed": True, "report": runner.start(ctx["vocab"], log=lambda s: print("  " + s))}
        except ParityError as e:
            rec["parity"] = {"passed": False, "error": str(e)}
            print(f"  {e}", flush=True)
    stage("parity", parity, needs=["load"])

    def tokens():
        for name, (decode, extend) in token_checks.items():
            runner = runner_for(ctx["art"], decode, extend, extend_seqs)
            runner.capture()  # the parity stage checked keys of both kinds; these are the token check's sizes
            sync = synchronizer(dev)
            prompts = prompts_for(ctx["vocab"], prompt_lens)
            eager_logits, graph_logits = [], []
            eager, _ = greedy(runner, runner.state_pool, prompts, args.new_tokens, sync=sync, eager=True,
                              logits=eager_logits)
            graphs, keys = greedy(runner, runner.state_pool, prompts, args.new_tokens, sync=sync,
                                  logits=graph_logits)
            rec.setdefault("tokens", {})[name] = t = {
                **compare(eager, graphs, prompt_lens), "keys": key_names(keys),
                **logit_drift(eager_logits, graph_logits, eager, graphs),
                "step0_logits_rel_err": rel_err(graph_logits[0], eager_logits[0])}
            print(f"  {name} padding: graph (padded) vs eager (unpadded): {t['mismatched']} of {t['tokens']} tokens "
                  f"differ; keys {t['keys']}; step-0 logits rel err {t['step0_logits_rel_err']:.3g}; per step "
                  f"{t['logits_rel_err_per_step'][:6]}; top-2 gap at first difference "
                  f"{t['eager_top2_gap_at_first_diff']}", flush=True)
            del runner
    stage("tokens", tokens, needs=["load"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for padding_probe.json")
    p.add_argument("--work", help="folder for checkpoints and artifacts (default: a temporary folder)")
    p.add_argument("--families", default="qwen3_next,qwen3_5,kimi_linear,bailing_linear")
    p.add_argument("--size", default=None, help="checkpoint size (default: bench on cuda, tiny on cpu)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--num-prompts", type=int, default=32, help="prompts in the token check")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt in the token check")
    p.add_argument("--skip", default="", help="comma-separated stage names not to run")
    p.add_argument("--reuse", action="store_true", help="use the checkpoint and artifact an earlier run left in --work")
    args = p.parse_args(argv)
    args.size = args.size or ("bench" if args.device == "cuda" else "tiny")
    args.skip = [s for s in args.skip.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hgc_probe_"))
    doc = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "size": args.size,
           "families": {}}
    path = out / "padding_probe.json"

    def save():
        path.write_text(json.dumps(doc, indent=1, default=str))
    with torch.no_grad():
        for family in args.families.split(","):
            rec = doc["families"].setdefault(family, {})
            run_guarded(f"{family} {args.size}", rec, lambda: run_family(family, args, work, rec, save))
            save()
    print(f"\n{'family':16s} {'probe logits':>12s} {'first op differing':28s} {'moe flips':>9s} {'parity':>7s} "
          f"{'tokens differ (heavy)':>21s} {'step-0 err':>10s}")
    for family, rec in doc["families"].items():
        pr, tk = rec.get("probe", {}), rec.get("tokens", {}).get("heavy", {})
        first = pr.get("first_op_computing_differently") or {}
        flips = sum(m["flipped_tokens"] for m in pr.get("moe", []))
        print(f"{family:16s} {pr.get('logits_rel_err', float('nan')):12.3g} "
              f"{(str(first.get('layer')) + ' ' + first.get('op', '')) if first else '-':28s} {flips:9d} "
              f"{str(rec.get('parity', {}).get('passed', '-')):>7s} "
              f"{str(tk.get('mismatched', '-')) + '/' + str(tk.get('tokens', '-')):>21s} "
              f"{tk.get('step0_logits_rel_err', float('nan')):10.3g}")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
