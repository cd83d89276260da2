"""End-to-end check of the GPU graph path: compile for cuda, load, eager tokens, capture, parity, graph tokens, timings.

On the GPU machine (benchmarks/gpu_call.sh has the wheel install line):

    python3 benchmarks/serving/gpu_graphs.py --out $OUT [--sizes small-hd64,bench] [--families qwen3_next,kimi_linear]
    python3 benchmarks/serving/gpu_graphs.py --out $OUT --sizes bench --num-prompts 32 --new-tokens 64   # issue 6.4
    python3 benchmarks/serving/gpu_graphs.py --dry-run --out /tmp/gg --sizes tiny   # CPU: every step, CPU reference
                                                                             # backend, graphs rerun (testkit/graph_cases.py)

Steps, per checkpoint size:
1. `hgc init-model --family qwen3_next --size S` (or, for S = "small-hd64", the small config with
   head_dim 64: FlashInfer builds no prefill for small's head dim 32) and `hgc compile --target
   cuda --dtype bfloat16` (compiled here: .pt2 programs are tied to the torch release).
2. load on cuda, pools for 32 requests x 512 tokens (bf16 KV), backends = the ones routing.json names (art.backends).
3. greedy tokens through a GraphRunner that was never captured (its eager path), for 8 prompts
   of mixed lengths (one prefill step of 421 tokens, then decode at batch 8) x 32 new tokens.
4. capture (decode buckets 1..32, extend buckets 256 and 512), timed.
5. start-up parity (runtime/graphs/startup_parity.py `check_parity`), its per-key relative errors printed.
6. the same greedy run through the captured runner (prefill -> extend[512] piecewise, decode ->
   decode[8] full graph), compared with step 3: mismatch rate and first differing position.
   bf16 runs may legitimately part late (different kernels for padded shapes): reported, not hidden.
7. decode step latency at batch 1, 8, 32 (eager vs graph), extend of 256 / 512 tokens (eager vs
   piecewise): CUDA events around `GraphRunner.run` (host metadata + copies included), median.
8. piecewise decode (decode_graphs="piecewise": the extend plan's pieces, ops in eager gaps) at
   batch 1, 8, 32 on a second runner, after its own parity check.
Every stage is wrapped: a failure is printed with its traceback, recorded in the JSON, and the
next stage that does not depend on it still runs. A short table is printed last; JSON to --out.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

import torch  # noqa: E402


from bench_common import (Stages, compare, run_guarded, decode_batch, key_names, prompts_for, synchronizer,  # noqa: E402
                          time_ms, write_checkpoint_hd64)
from hgc import main as hgc  # noqa: E402
from testkit.graph_cases import greedy  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.engine.generate import make_pools  # noqa: E402
from runtime.graphs.runner import GraphRunner  # noqa: E402
from runtime.graphs.startup_parity import check_parity  # noqa: E402
from runtime.artifact.loader import load_artifact  # noqa: E402

PROMPT_LENS = (3, 9, 17, 30, 48, 64, 100, 150)  # 421 tokens: the first step fits extend[512]
NEW_TOKENS = 32
MAX_SEQS, MAX_LEN, PAGE = 32, 512, 16
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32)
EXTEND_BUCKETS = (256, 512)
EXTEND_MAX_SEQS = 16


def run_size(family: str, size: str, args, work: Path, rec: dict, save) -> None:
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dtype = "bfloat16"
    stage = Stages(rec.setdefault("stages", {}), save=save)
    # --dry-run: the CPU reference backend and testkit/graph_cases.RerunGraphs standing in for CUDA
    # graphs, so every stage's bookkeeping runs on a CPU before a GPU run is spent on it.
    graphs = None
    if args.dry_run:
        from testkit.graph_cases import RerunGraphs
        graphs = RerunGraphs()

    def make_ops(art, kv, st):
        # the backends the artifact's routing.json names: FlashInfer, Triton linear and MoE on cuda,
        # the CPU reference in a --dry-run (compiled for cpu)
        return art.backends(kv, st).op_table("main")
    ckpt, art_dir = work / f"ckpt_{family}_{size}", work / f"art_{family}_{size}"
    prompt_lens = [PROMPT_LENS[i % len(PROMPT_LENS)] for i in range(args.num_prompts)]
    ctx = {}

    def build():
        if size.endswith("-hd64"):
            write_checkpoint_hd64(size[: -len("-hd64")], ckpt, family)
        elif hgc(["init-model", "--family", family, "--size", size, "--seed", "0", "-o", str(ckpt),
                  "--force"]) != 0:
            raise RuntimeError("init-model failed")
        target = "cpu" if args.dry_run else "cuda"
        if hgc(["compile", str(ckpt), "-o", str(art_dir), "--target", target, "--dtype", dtype, "--no-dumps",
                "--force", "--no-inductor"]) != 0:
            raise RuntimeError("compile failed")
    stage("1_init_compile", build)

    def load():
        art = load_artifact(art_dir, dev)
        kv, st = make_pools(art.registry, MAX_LEN, MAX_SEQS, page_size=PAGE, device=dev,
                            kv_dtype=getattr(torch, dtype))
        ops = make_ops(art, kv, st)
        backend = ops.backend
        runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=DECODE_BUCKETS,
                             extend_buckets=EXTEND_BUCKETS, max_pages_per_seq=MAX_LEN // PAGE,
                             extend_max_seqs=EXTEND_MAX_SEQS, graphs=graphs)
        vocab = int(art.program_fqns and art.weights[next(k for k in art.weights if "embed" in k)].shape[0])
        ctx.update(art=art, kv=kv, st=st, backend=backend, runner=runner, vocab=vocab)
        rec["backend"] = backend.name
        rec["full_decode_graph"] = runner.full_decode
        rec["vocab"] = vocab
        rec["params"] = sum(w.numel() for w in art.weights.values())
        print(f"  backend {backend.name}; full decode graph: {runner.full_decode}; "
              f"{rec['params'] / 1e6:.1f}M params; vocab {vocab}", flush=True)
    stage("2_load", load, needs=["1_init_compile"])

    sync = synchronizer(dev)

    def eager_tokens():
        prompts = prompts_for(ctx["vocab"], prompt_lens)
        outs, keys = greedy(ctx["runner"], ctx["st"], prompts, args.new_tokens, sync=sync)
        ctx.update(prompts=prompts, eager=outs)
        rec["eager_tokens_head"] = [o[:8] for o in outs]
        rec["eager_keys"] = key_names(keys)
    stage("3_eager_tokens", eager_tokens, needs=["2_load"])

    def capture():
        sync()
        t0 = time.perf_counter()
        ctx["runner"].capture()
        sync()
        rec["capture_s"] = time.perf_counter() - t0
        rec["captured_keys"] = [str(k) for k in ctx["runner"].keys]
        if dev.type == "cuda":
            rec["graph_pool_mem_GiB"] = torch.cuda.memory_reserved() / 2**30
        print(f"  captured {len(ctx['runner'].keys)} keys in {rec['capture_s']:.2f} s", flush=True)
    stage("4_capture", capture, needs=["2_load"])

    def parity():
        report = check_parity(ctx["runner"], vocab_size=ctx["vocab"])
        rec["parity"] = report
        for k, v in report.items():
            print(f"  parity {k}: rel err {v:.3g}", flush=True)
    stage("5_parity", parity, needs=["4_capture"])

    def graph_tokens():
        runner = ctx["runner"]
        before = dict(runner.counters)
        outs, keys = greedy(runner, ctx["st"], ctx["prompts"], args.new_tokens, sync=sync)
        rec["graph_keys"] = key_names(keys)
        rec["graph_counters"] = {k: runner.counters[k] - before[k] for k in before}
        cmp = compare(ctx["eager"], outs, prompt_lens)
        rec["tokens_vs_eager"] = cmp
        print(f"  keys {rec['graph_keys']}; counters {rec['graph_counters']}", flush=True)
        print(f"  graph vs eager: {cmp['mismatched']}/{cmp['tokens']} tokens differ "
              f"(rate {cmp['mismatch_rate']:.3f}); first differing position {cmp['first_diff']}; "
              f"per prompt {cmp['first_diff_per_prompt']}", flush=True)
    stage("6_graph_tokens", graph_tokens, needs=["4_capture", "3_eager_tokens"])

    def timings():
        runner, kv, st = ctx["runner"], ctx["kv"], ctx["st"]
        vocab = ctx["vocab"]
        g = torch.Generator().manual_seed(2)
        out = rec.setdefault("timings_ms", {})
        for B in (1, 8, 32):
            with decode_batch(runner, st, B, vocab, g) as items:
                eager_step = build_step(items, kv, "cpu", max_pages=runner.max_pages)
                graph_step, key = runner.build(items)
                e = time_ms(lambda: runner.run(eager_step, None), dev, args.iters)
                r = time_ms(lambda: runner.run(graph_step, key), dev, args.iters)
                out[f"decode_b{B}"] = {"eager": e, "graph": r, "key": str(key)}
                print(f"  decode B={B}: eager {e:.3f} ms, graph {r:.3f} ms ({key})", flush=True)
        for T in (256, 512):
            seqs = [SeqState(st.alloc()) for _ in range(2)]
            try:
                items = [(seqs[0], torch.randint(1, vocab, (T // 2,), generator=g).tolist()),
                         (seqs[1], torch.randint(1, vocab, (T - T // 2,), generator=g).tolist())]
                eager_step = build_step(items, kv, "cpu", max_pages=runner.max_pages)
                graph_step, key = runner.build(items)
                # repeated fresh prefills of the same two requests: same pages, same work each time
                e = time_ms(lambda: runner.run(eager_step, None), dev, args.iters)
                r = time_ms(lambda: runner.run(graph_step, key), dev, args.iters)
                out[f"extend_t{T}"] = {"eager": e, "piecewise": r, "key": str(key)}
                print(f"  extend T={T}: eager {e:.3f} ms, piecewise {r:.3f} ms ({key})", flush=True)
            finally:
                for s in seqs:
                    kv.free(s.pages)
                    st.free(s.slot)
    stage("7_timings", timings, needs=["4_capture"])

    def piecewise_decode():
        """Decode through the extend plan's pieces (attention and linear ops in eager gaps), on a
        second runner with its own backend instance (its own static buffers), same pools."""
        art, kv, st, vocab = ctx["art"], ctx["kv"], ctx["st"], ctx["vocab"]
        ops = make_ops(art, kv, st)
        runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=(1, 8, 32), extend_buckets=(),
                             max_pages_per_seq=MAX_LEN // PAGE, extend_max_seqs=EXTEND_MAX_SEQS,
                             decode_graphs="piecewise", graphs=graphs)
        runner.capture()
        rec["piecewise_decode_parity"] = check_parity(runner, vocab_size=vocab)
        g = torch.Generator().manual_seed(3)
        out = rec.setdefault("timings_ms", {})
        for B in (1, 8, 32):
            with decode_batch(runner, st, B, vocab, g) as items:
                step, key = runner.build(items)
                t = time_ms(lambda: runner.run(step, key), dev, args.iters)
                out.setdefault(f"decode_b{B}", {})["piecewise"] = t
                print(f"  decode B={B}: piecewise {t:.3f} ms ({key})", flush=True)
    stage("8_piecewise_decode", piecewise_decode, needs=["4_capture"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="small-hd64,bench",
                   help="comma-separated checkpoint sizes, in order; SIZE-hd64 = SIZE with head_dim 64")
    p.add_argument("--work", default=None, help="folder for checkpoints and artifacts (default: a temporary folder outside OUT: a "
                   "bench checkpoint is gigabytes, and what is under OUT travels back)")
    p.add_argument("--families", default="qwen3_next", help="comma-separated families, each run at every size")
    p.add_argument("--num-prompts", type=int, default=len(PROMPT_LENS),
                   help=f"greedy prompts of stages 3 and 6 (lengths cycle through {PROMPT_LENS}; at most {MAX_SEQS})")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: CPU reference backend, CUDA graphs replaced by reruns (testkit/graph_cases.py)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hgc_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    doc = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu",
           "command": " ".join(sys.argv), "dry_run": args.dry_run, "sizes": {},
           # kernels built by an earlier call (benchmarks/jit_cache.py): first-use times are then not cold
           "jit_cache_files_at_start": sum(1 for _ in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*"))
           if os.environ.get("TRITON_CACHE_DIR") and Path(os.environ["TRITON_CACHE_DIR"]).is_dir() else 0}
    if not 1 <= args.num_prompts <= MAX_SEQS:
        p.error(f"--num-prompts must be 1 to {MAX_SEQS}")
    runs = [(family, size) for family in args.families.split(",") for size in args.sizes.split(",")]

    def save():
        (out / "gpu_graphs.json").write_text(json.dumps(doc, indent=1, default=str))
    for family, size in runs:
        rec = doc["sizes"].setdefault(f"{family} {size}", {})
        run_guarded(f"{family} {size}", rec, lambda: run_size(family, size, args, work, rec, save))
        save()
    # -- the table, last ----------------------------------------------------------------------
    print(f"\n== gpu_graphs on {doc['device']} (torch {doc['torch']}) ==")
    for size, rec in doc["sizes"].items():
        st = {k: v["status"] for k, v in rec.get("stages", {}).items()}
        print(f"{size}: stages {st}")
        if "capture_s" in rec:
            print(f"  capture {rec['capture_s']:.2f} s for {len(rec['captured_keys'])} keys")
        if "parity" in rec:
            print("  parity rel err: " + ", ".join(f"{k} {v:.2g}" for k, v in rec["parity"].items()))
        if "tokens_vs_eager" in rec:
            c = rec["tokens_vs_eager"]
            print(f"  graph vs eager tokens: {c['mismatched']}/{c['tokens']} differ, first at {c['first_diff']}")
        if rec.get("timings_ms"):
            print(f"  {'step':<12}{'eager ms':>10}{'full ms':>10}{'piecewise ms':>14}{'eager/best':>12}")
            for name, t in rec["timings_ms"].items():
                cells = [t.get(k) for k in ("eager", "graph", "piecewise")]
                best = min((c for c in cells[1:] if c), default=None)
                text = "".join(f"{c:>{w}.3f}" if c else f"{'-':>{w}}" for c, w in zip(cells, (10, 10, 14)))
                ratio = f"{t['eager'] / best:>11.2f}x" if best and t.get("eager") else ""
                print(f"  {name:<12}{text}{ratio}")
    print(f"JSON: {out / 'gpu_graphs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
