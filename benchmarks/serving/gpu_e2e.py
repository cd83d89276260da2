"""End-to-end benchmark: hgc's runtime (eager, piecewise, full-graph decode) against the same model
under torch.compile and against transformers, on one checkpoint per family, with the floor.

On the GPU machine (benchmarks/gpu_call.sh has the wheel install line), one run:

    python3 benchmarks/serving/gpu_e2e.py --out $OUT                  # qwen3_next and bailing_linear, bench size
    python3 benchmarks/serving/gpu_e2e.py --dry-run --out /tmp/e2e    # CPU: tiny size, CPU reference backend,
                                                                      # graphs rerun (testkit/graph_cases.py)
then, on the CPU machine: `python benchmarks/plots/plot_e2e.py OUT/gpu_e2e.json --png e2e.png --md e2e.md`.
Where one call has a time limit, `--families qwen3_next` and `--families bailing_linear` in two
calls keep every ratio of a family within one run on one card.

Issue 14's numbers alone (extend over 1, 4 and 16 requests with its eager gaps, mixed steps,
transformers' prefill of the same batches), one call per family (F=qwen3_next, then in a second
call F=bailing_linear); from the stage times of the full runs, about 3 to 5 minutes each:

    S=piecewise_decode,floor,torch_compile,hf_eager,hf_static
    bash benchmarks/gpu_call.sh python3 benchmarks/serving/gpu_e2e.py --out $OUT --keep-caches --skip $S --families $F

(--keep-caches: the kernel caches gpu_call.sh carries, so the capture does not build every kernel
again; start-up is then not a cold number.)

Once per run, `copy_bandwidth`: the device-to-device copy rate (bytes read + written), the
denominator of every floor. Then, per family (stages are skipped with `--skip NAME,...`):
1. init_compile: `hgc init-model`, `hgc compile --target cuda --dtype bfloat16` (SIZE-hd64: the
   size with attention head_dim 64, for FlashInfer, which builds no head dim 32).
2. load: artifact, pools (bf16 KV), backend, a GraphRunner with full decode graphs. Timed.
3. start: `runner.start` = capture of every bucket (decode 1..max batch, extend up to the largest
   extend size) + start-up parity. load + start is "load+capture", set against torch.compile's
   warm-up; capture and parity are also reported apart.
4. tokens: greedy tokens of a few prompts, every step eager vs through the graphs.
5. decode: per batch B, B requests with a 64-token history; their next decode step, eager
   (`run(step, None)`) and full graph; "full_graph_loop" adds what a serving loop pays per token
   around it (host build of the step, argmax read on the host), the unit transformers' generate
   is timed in.
6. extend: per T and per R in --extend-requests (default 1, 4, 16; R <= T), one step whose T
   tokens are the prefill of R fresh requests (equal shares, the remainder on the first), eager
   vs piecewise; during the piecewise runs a clock wraps every eager piece of the extend plan
   (CUDA events on the stream: the span each eager gap occupies, launch gaps included), reported
   as a fraction of the step. Rows `extend_tT` (R = 1, as before) and `extend_tT_rR`.
7. mixed: per T in --mixed-tokens (default: the extend sizes) and B in --mixed-batches (default
   1, 8, 32), one step of T tokens: B running requests with a 64-token history decoding one token
   each, then a fresh request's prefill chunk of T - B tokens, in the engine's order (running
   requests first) and at its token budget (chunks and decodes share it, so the step fills the
   T-token extend bucket as a serving step does; a chunk of T tokens beside them would pad to the
   next bucket). The runner sends a mixed step to the smallest extend bucket holding its tokens
   (runtime/graphs/buckets.py `key_for`) when the bucket's request rows (`extend_max_seqs`, here sized to
   hold B + 1) hold its requests: eager vs piecewise, the eager gaps' share, and for comparison
   the chunk alone (piecewise) plus the decode step alone (full graph), eager and through graphs.
8. piecewise_decode: a second runner, its own backend instance, decode_graphs="piecewise"
   (decode through the extend plan's pieces), started and timed at every B.
9. profile: host issue time against kernel time (torch.profiler) for decode at the smallest batch
   (full graph and eager) and the largest extend (piecewise), with the top kernels and host ops.
10. floor: bytes one decode step must read (every weight the main program reads, except routed
   experts, of which min(E, B * top_k) per MoE layer, the upper bound of distinct experts hit;
   B rows of the embedding; linear states read and written; KV of the 65-token context) over the
   copy bandwidth.
11. torch_compile: the family model from models/ on its own backend and pools,
   `torch.compile(mode="reduce-overhead", dynamic=False)`; per shape its first 3 calls (compile, cudagraph-tree
   warm-up and recording) minus 3 steady calls is its warm-up; steady decode and extend latency;
   greedy tokens against the same model uncompiled (stateful ops under cudagraph trees may give
   wrong tokens: reported as measured); dynamo's graph, graph-break and cudagraph-skip counts.
12. transformers (families it loads: qwen3_next): hf_load (`from_pretrained` of the same
   checkpoint folder in bf16, its loading report, the kernel fallbacks it logs: FLA or not),
   hf_eager / hf_static: `generate` of N new tokens at each B (history 64, greedy, exactly N),
   eager and with `cache_implementation="static"`; per-token decode latency = median of the
   intervals between consecutive tokens handed to a streamer, after the first (the first
   interval is the prefill); static compile time = first call - a steady call of the same shape.
   hf_prefill: per extend row, the forward of the same T tokens as a batch of R rows
   (`logits_to_keep=1`), CUDA events. Rows of unequal shares (T not a multiple of R) are
   left-padded to the longest with `attention_mask` 0 on the padding, as transformers' generate
   pads a decoder-only batch (the padded positions are computed too: "prefill_batches" records
   them); rows of equal shares (every default split) pass no mask, as the one-row forward did.
Timings: median of --iters runs (after --warmup calls) between CUDA events around the call (host
work inside the call included), perf_counter on the CPU. inductor's, Triton's and FlashInfer's on-disk caches start
empty (WORK/caches), so both start-ups are measured cold. Every stage is wrapped: a failure is printed with its
traceback, recorded in the JSON, and the stages that do not need it still run. The targets of the
issue are checked last (met / missed with the number); JSON to OUT/gpu_e2e.json, a short table last.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plots"))  # plot_e2e names gpu_e2e's row keys

import torch  # noqa: E402

from bench_common import (Stages, device_rates, run_guarded, compare, decode_batch, key_names, logit_drift,  # noqa: E402
                          profile_call, prompts_for, synchronizer, time_ms, verdict, write_checkpoint_hd64)
from hgc import main as hgc  # noqa: E402
from plot_e2e import parse_step, step_name  # noqa: E402
from testkit.graph_cases import greedy  # noqa: E402
from compiler.splitops import Mode, op_name_of  # noqa: E402
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.step.bound_ops import BoundOps  # noqa: E402
from runtime.engine.generate import make_pools  # noqa: E402
from runtime.backends.protocol import plan_eager_step  # noqa: E402
from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS  # noqa: E402
from runtime.graphs.runner import GraphRunner, step_on_device  # noqa: E402
from runtime.artifact.loader import load_artifact  # noqa: E402

PAGE = 16
HISTORY = 64  # tokens each decode request holds before the timed step
# The token checks: 126 tokens in one extend step, then decode at batch 4 (fewer prompts when the
# largest decode batch is smaller, so that their decode steps have a bucket too).
PROMPT_LENS = (5, 17, 40, 64)
FIRST_CALLS = 3  # torch.compile: compile + cudagraph-tree warm-up, recording, first replay
GPU_DEFAULTS = dict(size="bench", batches="1,8,32,128", extends="512,2048", iters=30, warmup=3, new_tokens=16,
                    hf_new_tokens=32, mixed_batches="1,8,32", profile_iters=5)
# The dry run walks every stage on a CPU; its sizes keep the reference backend and inductor's C++ builds short.
DRY_DEFAULTS = dict(size="tiny", batches="1,8", extends="64,128", iters=1, warmup=1, new_tokens=3, hf_new_tokens=4,
                    mixed_batches="1,2", profile_iters=1)
EXTEND_REQUESTS = "1,4,16"
# The extend graphs hold at least this many requests (the runs before the multi-request rows
# captured exactly this many; more when a timed step has more requests).
MIN_EXTEND_SEQS = 16
COLUMNS = ("eager", "piecewise", "full_graph", "full_graph_loop", "torch_compile", "hf_eager", "hf_static", "floor")


class EagerModel:
    """A family model from models/ (or its torch.compile'd self) as a runner: `build(items)` ->
    (step, None) and `run(step, None)`, what the greedy and timing helpers call, over its own pools.

    `run` is GraphRunner's eager path (step_on_device, plan_eager_step), then the forward inside
    `ops.step(ctx)`."""

    def __init__(self, forward, ops: BoundOps, kv_pool, max_pages: int, device: torch.device, chunk_size: int):
        self.forward, self.ops, self.kv_pool, self.max_pages = forward, ops, kv_pool, max_pages
        self.device, self.chunk_size = device, chunk_size

    def build(self, items):
        return build_step(items, self.kv_pool, "cpu", max_pages=self.max_pages), None

    def run(self, step, key=None) -> torch.Tensor:
        assert key is None, "an eager model has no captured keys"
        inputs, ctx = step_on_device(step, self.device)
        plan_eager_step(self.ops.backend, ctx, self.chunk_size)
        # A new step: cudagraph trees may then overwrite the previous step's outputs (read already).
        torch.compiler.cudagraph_mark_step_begin()
        with self.ops.step(ctx):
            return self.forward(*inputs)


class PieceClock(torch.nn.Module):
    """An eager piece of a split module with a clock around each call: CUDA events on the stream (the
    span the piece occupies there, host launch gaps included), perf_counter on the CPU."""

    def __init__(self, piece: torch.nn.Module, device: torch.device):
        super().__init__()
        self.piece, self.cuda = piece, device.type == "cuda"
        self.spans: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward(self, *args):
        start = self._mark()
        out = self.piece(*args)
        self.spans.append((start, self._mark()))
        return out

    def total_ms(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans)
        return sum(b - a for a, b in self.spans) * 1e3


@contextlib.contextmanager
def eager_piece_clocks(runner: GraphRunner):
    """Clocks around every eager piece of the runner's extend module (captured pieces stay as they
    are); the pieces are put back on exit."""
    module = runner._module(Mode.EXTEND)
    clocks = {}
    for piece in runner.program.plans[Mode.EXTEND].pieces:
        if piece.kind == "eager":
            name = f"submod_{piece.index}"
            clocks[name] = PieceClock(getattr(module, name), runner.device)
            setattr(module, name, clocks[name])
    try:
        yield list(clocks.values())
    finally:
        for name, clock in clocks.items():
            setattr(module, name, clock.piece)


def split_tokens(tokens: int, requests: int) -> list[int]:
    """`tokens` over `requests` requests: equal shares, the remainder on the first."""
    shares = [tokens // requests] * requests
    shares[0] += tokens % requests
    return shares


@contextlib.contextmanager
def prefill_requests(runner, state_pool, lens: list[int], vocab: int, g: torch.Generator):
    """The items of fresh requests of lens[i] random tokens each; their slots and pages are freed on exit."""
    seqs = [SeqState(state_pool.alloc()) for _ in lens]
    try:
        yield [(seq, torch.randint(1, vocab, (n,), generator=g).tolist()) for seq, n in zip(seqs, lens)]
    finally:
        for seq in seqs:
            runner.kv_pool.free(seq.pages)
            state_pool.free(seq.slot)


def step_and_gap_ms(run, clocks, device, iters: int) -> dict:
    """Median step time of run() and the share of it spent in the clocked eager pieces."""
    steps, gaps = [], []
    for _ in range(iters):
        for c in clocks:
            c.spans.clear()
        steps.append(time_ms(run, device, iters=1, warmup=0))
        gaps.append(sum(c.total_ms() for c in clocks))
    fractions = [g / s for g, s in zip(gaps, steps)]
    return {"step_ms": statistics.median(steps), "gap_ms": statistics.median(gaps),
            "fraction": statistics.median(fractions), "eager_pieces": len(clocks)}


def first_calls_s(fn, sync, n: int = FIRST_CALLS) -> list[float]:
    """Wall seconds of each of the first n calls, each waited for."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def decode_floor(art, kv_pool, state_pool, batch: int, context: int, copy_bytes_per_s: float) -> dict:
    """Bytes one decode step of `batch` requests with `context` tokens each must read (and write,
    for states), from the main program's graph, and that over the copy rate.

    Weights: every parameter the graph reads, except routed experts (the `w13` / `w2` inputs of
    each hgc.moe node: min(E, batch * top_k) experts of each, the upper bound of distinct experts
    hit) and the embedding table (`batch` rows). States: read and written once per linear layer
    and request. KV: `context` tokens per full layer and request. Draft layers are not counted."""
    ep = art.programs["main"]
    to_fqn = {**ep.graph_signature.inputs_to_parameters, **ep.graph_signature.inputs_to_buffers}
    fqns = art.program_fqns["main"]

    def weight(node):
        return art.weights[fqns[to_fqn[node.name]]]

    special, expert_bytes, embed_bytes = set(), 0, 0
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if op_name_of(node.target) == "moe":
            names = [a.name for a in node.target._schema.arguments]
            w13, w2 = node.args[names.index("w13")], node.args[names.index("w2")]
            top_k = int(node.args[names.index("top_k")])
            E = weight(w13).shape[0]
            per_expert = (weight(w13).nbytes + weight(w2).nbytes) // E
            expert_bytes += min(E, batch * top_k) * per_expert
            special |= {w13.name, w2.name}
        elif node.target == torch.ops.aten.embedding.default:
            table = weight(node.args[0])
            embed_bytes += batch * table[0].nbytes
            special.add(node.args[0].name)
    dense_bytes = sum(weight(n).nbytes for n in ep.graph.nodes
                      if n.op == "placeholder" and n.name in to_fqn and n.users and n.name not in special)
    main = [layer for layer in art.registry if not layer.draft]
    state_bytes = 2 * batch * sum(t[0].nbytes for layer in main if layer.is_linear
                                  for t in state_pool.buffers[layer.layer_id].values())
    kv_bytes = batch * context * sum(t[0, 0].nbytes for layer in main if layer.is_full
                                     for t in kv_pool.buffers[layer.layer_id].values())
    total = dense_bytes + expert_bytes + embed_bytes + state_bytes + kv_bytes
    return {"bytes": total, "dense_weights": dense_bytes, "experts": expert_bytes, "embedding_rows": embed_bytes,
            "states_read_written": state_bytes, "kv_read": kv_bytes, "ms": total / copy_bytes_per_s * 1e3}


def dynamo_counts() -> dict:
    """Dynamo / inductor counters that tell how much of a model torch.compile really compiled."""
    from torch._dynamo.utils import counters
    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "break_reasons": {k.split("\n")[0][:200]: v for k, v in counters["graph_break"].most_common(5)}}


def counts_since(before: dict, after: dict) -> dict:
    return {k: (after[k] - before[k] if isinstance(after[k], int) else after[k]) for k in after}


@contextlib.contextmanager
def logged(logger: str, *phrases: str):
    """The distinct messages that `logger` (or a child) logs meanwhile containing one of `phrases`
    (case-insensitive), with counts: the why behind a counter, or which kernels a library fell back from."""
    found: dict[str, int] = {}

    class Recorder(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if any(p in message.lower() for p in phrases):
                found[message[:300]] = found.get(message[:300], 0) + 1
    handler = Recorder()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield found
    finally:
        logging.getLogger(logger).removeHandler(handler)


def fresh_compile_caches(folder: Path) -> dict:
    """Point inductor's, Triton's and FlashInfer's on-disk caches at empty folders: both start-ups
    (our load+capture, torch.compile's warm-up) are then measured cold, as on a new machine, and a
    second run measures the same thing again (a warm inductor cache cut the dry run's warm-up 5x).
    Each library reads its variable when it compiles, after this."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
              "FLASHINFER_WORKSPACE_BASE": "flashinfer"}
    for variable, name in caches.items():
        shutil.rmtree(folder / name, ignore_errors=True)
        (folder / name).mkdir(parents=True)
        os.environ[variable] = str(folder / name)
    return {variable: os.environ[variable] for variable in caches}


def run_family(family: str, args, work: Path, rec: dict, copy_rate: float | None, save) -> None:
    from models.families import get_family
    from models.loader import load_config

    dev = torch.device("cpu" if args.dry_run else "cuda")
    stage = Stages(rec.setdefault("stages", {}), skip=args.skip, save=save)
    sync = synchronizer(dev)
    timings = rec.setdefault("timings_ms", {})

    def cell(step: str, column: str, value: float) -> None:
        timings.setdefault(step, {})[column] = value

    def make_graphs():
        # --dry-run: testkit/graph_cases.RerunGraphs stands in for CUDA graphs (reruns the ops)
        if not args.dry_run:
            return None
        from testkit.graph_cases import RerunGraphs
        return RerunGraphs()

    def make_ops(art, kv, st):
        # the backends the artifact's routing.json names: FlashInfer, Triton linear and MoE on cuda,
        # the CPU reference in a --dry-run (compiled for cpu); the eager model's calls go to the same
        # instance per layer as the graph's nodes
        return art.backends(kv, st).op_table("main")

    batches, extends = args.batch_list, args.extend_list
    mixed_batches = args.mixed_batch_list
    prompt_lens = PROMPT_LENS[: max(batches)]
    max_len = -(-max(max(extends), HISTORY + 1, max(prompt_lens) + args.new_tokens) // PAGE) * PAGE
    most_requests = max(max(args.extend_request_list), 1 + max(mixed_batches))  # of a timed extend or mixed step
    num_seqs = max(max(batches), most_requests)
    # Request rows of the extend graphs: enough for every timed extend and mixed step (the engine
    # captures as many as its largest decode bucket: runtime/graphs/buckets.extend_seqs); an extend
    # bucket smaller than its request rows is never captured.
    extend_max_seqs = min(max(MIN_EXTEND_SEQS, most_requests), min(extends))
    decoding = [*batches, *mixed_batches]  # a mixed step's decodes are timed alone too, through a decode graph
    decode_buckets = tuple(sorted({b for b in DEFAULT_DECODE_BATCH_SIZES if b <= max(decoding)} | set(decoding)))
    extend_buckets = tuple(sorted({t for t in DEFAULT_EXTEND_TOKEN_COUNTS if t <= max(extends)} | set(extends)))
    rec["buckets"] = {"decode": decode_buckets, "extend": extend_buckets, "extend_max_seqs": extend_max_seqs}
    # artifacts of other routes sit beside each other in one --work: the folder names a digest of them
    routed = "-r" + hashlib.sha256("\n".join(args.route).encode()).hexdigest()[:8] if args.route else ""
    ckpt, art_dir = work / f"ckpt_{family}_{args.size}", work / f"art_{family}_{args.size}{routed}"
    rec["routes"] = list(args.route)
    rec["glue"] = "compiled" if args.compiled_glue else "traced"
    ctx: dict = {}

    def init_compile():
        if args.size.endswith("-hd64"):
            write_checkpoint_hd64(args.size[: -len("-hd64")], ckpt, family)
        elif hgc(["init-model", "--family", family, "--size", args.size, "--seed", "0", "-o", str(ckpt),
                  "--force"]) != 0:
            raise RuntimeError("init-model failed")
        target = "cpu" if args.dry_run else "cuda"
        # --no-inductor: the traced glue, the numbers' "before" (benchmarks/serving/startup_bench.py measures
        # compiled pieces); --compiled-glue builds the target bundle (an error where it cannot)
        glue = ["--inductor"] if args.compiled_glue else ["--no-inductor"]
        argv = ["compile", str(ckpt), "-o", str(art_dir), "--target", target, "--dtype", "bfloat16", "--no-dumps",
                "--force", *glue, *[a for r in args.route for a in ("--route", r)]]
        # A bundle's build imports FlashInfer, and a process that has imported it cannot point its module
        # cache at a bundle's copy (runtime/artifact/bundle.py): that build runs in a process of its own.
        if args.compiled_glue:
            rc = subprocess.run([sys.executable, "-m", "hgc", *argv], cwd=Path(__file__).resolve().parents[2]).returncode
        else:
            rc = hgc(argv)
        if rc != 0:
            raise RuntimeError("compile failed")
    stage("init_compile", init_compile)

    def pools(art):
        return make_pools(art.registry, max_len, num_seqs, page_size=PAGE, device=dev, kv_dtype=torch.bfloat16)

    def load():
        sync()
        t0 = time.perf_counter()
        art = load_artifact(art_dir, dev)
        kv, st = pools(art)
        ops = make_ops(art, kv, st)
        runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=decode_buckets,
                             extend_buckets=extend_buckets, max_pages_per_seq=max_len // PAGE,
                             extend_max_seqs=extend_max_seqs, decode_graphs="full", graphs=make_graphs())
        sync()
        rec["load_s"] = time.perf_counter() - t0
        vocab = int(load_config(ckpt)[2]["vocab_size"])
        ctx.update(art=art, kv=kv, st=st, runner=runner, vocab=vocab)
        rec.update(backend=ops.backend.name, full_decode_graph=runner.full_decode, vocab=vocab,
                   params=sum(w.numel() for w in art.weights.values()))
        print(f"  backend {rec['backend']}; full decode graph: {runner.full_decode}; {rec['params'] / 1e6:.1f}M "
              f"params; loaded in {rec['load_s']:.2f} s", flush=True)
    stage("load", load, needs=["init_compile"])

    def start_runner(runner) -> dict:
        """runner.start (capture, then parity) with the time of each half, from the moments it logs."""
        marks = [time.perf_counter()]

        def log(line):
            marks.append(time.perf_counter())
            print(f"  {line}", flush=True)
        parity = runner.start(ctx["vocab"], log=log)
        return {"capture_s": marks[1] - marks[0], "parity_s": marks[2] - marks[1], "start_s": marks[2] - marks[0],
                "keys": [str(k) for k in runner.keys], "parity": parity}

    def start():
        started = start_runner(ctx["runner"])
        rec["start"] = started
        rec["load_capture_s"] = rec["load_s"] + started["start_s"]
        if dev.type == "cuda":
            rec["memory_reserved_GiB"] = torch.cuda.memory_reserved() / 2**30
    stage("start", start, needs=["load"])

    def tokens():
        runner, st = ctx["runner"], ctx["st"]
        prompts = prompts_for(ctx["vocab"], prompt_lens)
        eager_logits, graph_logits = [], []
        eager, _ = greedy(runner, st, prompts, args.new_tokens, sync=sync, eager=True, logits=eager_logits)
        graphs, keys = greedy(runner, st, prompts, args.new_tokens, sync=sync, logits=graph_logits)
        keys = key_names(keys)
        ctx.update(prompts=prompts, eager_tokens=eager)
        rec["tokens_graph_vs_eager"] = {**compare(eager, graphs, prompt_lens), "keys": keys,
                                        **logit_drift(eager_logits, graph_logits, eager, graphs)}
        t = rec["tokens_graph_vs_eager"]
        print(f"  graphs vs eager: {t['mismatched']} of {t['tokens']} tokens differ; keys {keys}; logits rel err "
              f"per step until the first difference {t['logits_rel_err_per_step']}; eager top-2 gap there "
              f"{t['eager_top2_gap_at_first_diff']}", flush=True)
    stage("tokens", tokens, needs=["start"])

    def timed(fn) -> float:
        return time_ms(fn, dev, args.iters, warmup=args.warmup)

    def eager_and_graphs(name: str, items, column: str):
        """Time the step of `items` eagerly and through the started runner's graphs; (graph step, key).
        A step that no captured key holds (key None) has its eager time only."""
        runner = ctx["runner"]
        eager_step = build_step(items, runner.kv_pool, "cpu", max_pages=runner.max_pages)
        graph_step, key = runner.build(items)
        cell(name, "eager", timed(lambda: runner.run(eager_step, None)))
        if key is not None:
            cell(name, column, timed(lambda: runner.run(graph_step, key)))
        return graph_step, key

    def piecewise_and_gaps(name: str, items) -> dict:
        """An extend or mixed step eager vs piecewise, then the share of the piecewise step its
        eager pieces take: {"key", "step_ms", "gap_ms", "fraction", "eager_pieces"} ("key" None,
        nothing else, where no extend bucket holds the step)."""
        runner = ctx["runner"]
        graph_step, key = eager_and_graphs(name, items, "piecewise")
        if key is None:
            return {"key": None}
        with eager_piece_clocks(runner) as clocks:
            gaps = step_and_gap_ms(lambda: runner.run(graph_step, key), clocks, dev, args.iters)
        return {"key": str(key), **gaps}

    def decode():
        runner, st = ctx["runner"], ctx["st"]
        g = torch.Generator().manual_seed(2)
        for B in batches:
            with decode_batch(runner, st, B, ctx["vocab"], g, HISTORY) as items:
                _, key = eager_and_graphs(f"decode_b{B}", items, "full_graph")
                cell(f"decode_b{B}", "full_graph_loop",
                     timed(lambda: runner.run(*runner.build(items)).argmax(-1).tolist()))
            t = timings[f"decode_b{B}"]
            print(f"  decode B={B}: eager {t['eager']:.3f} ms, full graph {t['full_graph']:.3f} ms ({key}), "
                  f"with host loop {t['full_graph_loop']:.3f} ms", flush=True)
    stage("decode", decode, needs=["start"])

    def describe(name: str, row: dict) -> str:
        t = timings[name]
        if row["key"] is None:
            return f"eager {t['eager']:.3f} ms; no captured bucket holds it"
        return (f"eager {t['eager']:.3f} ms, piecewise {t['piecewise']:.3f} ms ({row['key']}); eager pieces "
                f"{row['fraction']:.1%} of the step")

    def extend():
        runner = ctx["runner"]
        g = torch.Generator().manual_seed(3)
        gaps = rec.setdefault("extend_eager_gaps", {})  # keyed by the row's name after "extend_t": "512", "512_r4"
        for T in extends:
            for R in (r for r in args.extend_request_list if r <= T):
                name = step_name("extend", T, R)
                # repeated fresh prefills of the same requests: same pages, same work each time
                with prefill_requests(runner, ctx["st"], split_tokens(T, R), ctx["vocab"], g) as items:
                    row = piecewise_and_gaps(name, items)
                if row["key"] is not None:
                    gaps[name[len("extend_t"):]] = row
                print(f"  extend T={T} over {R} requests: {describe(name, row)}", flush=True)
    stage("extend", extend, needs=["start"])

    def mixed():
        """Mixed steps against their chunk alone plus their decode step alone (stage 7 of the docstring)."""
        runner, st = ctx["runner"], ctx["st"]
        g = torch.Generator().manual_seed(6)
        out = rec.setdefault("mixed", {})

        def alone(items) -> dict:
            """A step by itself, eagerly and as the runner runs it (decode: full graph; extend: piecewise)."""
            eager_step = build_step(items, runner.kv_pool, "cpu", max_pages=runner.max_pages)
            step, key = runner.build(items)
            return {"key": str(key) if key else None, "eager": timed(lambda: runner.run(eager_step, None)),
                    "graphs": timed(lambda: runner.run(step, key))}
        for B in mixed_batches:
            with decode_batch(runner, st, B, ctx["vocab"], g, HISTORY) as decodes:
                decode_alone = alone(decodes)
                for T in (t for t in args.mixed_token_list if t > B):
                    name = step_name("mixed", T, B)
                    with prefill_requests(runner, st, [T - B], ctx["vocab"], g) as chunk:
                        row = {"decodes": B, "chunk_tokens": T - B, **piecewise_and_gaps(name, decodes + chunk)}
                        row.update(chunk_alone=alone(chunk), decode_alone=decode_alone)
                    row["alone_ms"] = row["chunk_alone"]["graphs"] + decode_alone["graphs"]
                    row["alone_eager_ms"] = row["chunk_alone"]["eager"] + decode_alone["eager"]
                    row["graphs_over_alone"] = timings[name].get("piecewise", timings[name]["eager"]) / row["alone_ms"]
                    out[name] = row
                    print(f"  mixed T={T} (chunk {T - B}, {B} decodes): {describe(name, row)}; chunk alone "
                          f"{row['chunk_alone']['graphs']:.3f} ms + decode alone {decode_alone['graphs']:.3f} ms "
                          f"({decode_alone['key']})", flush=True)
    stage("mixed", mixed, needs=["start"])

    def piecewise_decode():
        art, kv, st = ctx["art"], ctx["kv"], ctx["st"]
        ops = make_ops(art, kv, st)
        runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=batches, extend_buckets=(),
                             max_pages_per_seq=max_len // PAGE, extend_max_seqs=extend_max_seqs,
                             decode_graphs="piecewise", graphs=make_graphs())
        rec["piecewise_start"] = start_runner(runner)
        g = torch.Generator().manual_seed(2)
        for B in batches:
            with decode_batch(runner, st, B, ctx["vocab"], g, HISTORY) as items:
                step, key = runner.build(items)
                cell(f"decode_b{B}", "piecewise", timed(lambda: runner.run(step, key)))
            print(f"  decode B={B}: piecewise {timings[f'decode_b{B}']['piecewise']:.3f} ms ({key})", flush=True)
    stage("piecewise_decode", piecewise_decode, needs=["load"])

    def profile():
        """Host issue time against kernel time for the smallest decode batch (full graph and eager)
        and the largest extend (piecewise): what the step time is made of."""
        runner, st = ctx["runner"], ctx["st"]
        prof = rec.setdefault("profile", {})
        g = torch.Generator().manual_seed(4)
        B, T = min(batches), max(extends)
        with decode_batch(runner, st, B, ctx["vocab"], g, HISTORY) as items:
            step, key = runner.build(items)
            eager_step = build_step(items, runner.kv_pool, "cpu", max_pages=runner.max_pages)
            prof[f"decode_b{B}_full_graph"] = profile_call(lambda: runner.run(step, key), dev, args.profile_iters)
            prof[f"decode_b{B}_eager"] = profile_call(lambda: runner.run(eager_step, None), dev, args.profile_iters)
        with prefill_requests(runner, st, [T], ctx["vocab"], g) as items:
            step, key = runner.build(items)
            prof[f"extend_t{T}_piecewise"] = profile_call(lambda: runner.run(step, key), dev, args.profile_iters)
        for name, p in prof.items():
            print(f"  {name}: host issue {p['host_issue_ms']:.3f} ms, kernels {p['kernel_ms']:.3f} ms in "
                  f"{p['kernels_per_call']:.0f} launches", flush=True)
            for r in p["top_kernels"][:8]:
                print(f"    kernel {r['ms']:8.4f} ms x{r['calls']:.0f}  {r['name']}", flush=True)
            for r in p["top_host_ops"][:6]:
                print(f"    host   {r['ms']:8.4f} ms x{r['calls']:.0f}  {r['name']}", flush=True)
    stage("profile", profile, needs=["start"])

    def floor():
        if copy_rate is None:
            raise RuntimeError("no copy bandwidth was measured in this run")
        floors = rec.setdefault("floor", {})
        for B in batches:
            floors[str(B)] = decode_floor(ctx["art"], ctx["kv"], ctx["st"], B, HISTORY + 1, copy_rate)
            cell(f"decode_b{B}", "floor", floors[str(B)]["ms"])
            print(f"  decode B={B}: {floors[str(B)]['bytes'] / 1e6:.1f} MB -> floor {floors[str(B)]['ms']:.3f} ms",
                  flush=True)
    stage("floor", floor, needs=["load"])

    def compiled_model():
        from models.loader import load_checkpoint

        t0 = time.perf_counter()
        _, _, model = load_checkpoint(ckpt, dtype=torch.bfloat16, device=dev)
        art = ctx["art"]
        kv, st = pools(art)
        ops = make_ops(art, kv, st)
        model.set_ops(ops)
        out = rec.setdefault("torch_compile", {"model_load_s": time.perf_counter() - t0,
                                               "recompile_limit": torch._dynamo.config.recompile_limit})
        eager = EagerModel(model, ops, kv, max_len // PAGE, dev, max(extend_buckets))
        # dynamic=False: one graph per shape, as reduce-overhead's CUDA graphs need anyway; with
        # automatic dynamic shapes dynamo fails inside the Triton launches (a symbolic grid size).
        compiled = EagerModel(torch.compile(model, mode="reduce-overhead", dynamic=False), ops, kv, max_len // PAGE,
                              dev, max(extend_buckets))
        before = dynamo_counts()
        warm = out.setdefault("warmup", {})

        def measure(name, step):
            first = first_calls_s(lambda: compiled.run(step), sync)
            ms = timed(lambda: compiled.run(step))
            cell(name, "torch_compile", ms)
            warm[name] = {"first_calls_s": first, "warmup_s": sum(first) - FIRST_CALLS * ms / 1e3}
            print(f"  {name}: torch.compile {ms:.3f} ms; first calls {', '.join(f'{s:.2f}' for s in first)} s",
                  flush=True)
        g = torch.Generator().manual_seed(2)
        try:
            with logged("torch", "skipping cudagraphs") as out["cudagraph_skip_reasons"]:
                for B in batches:
                    # the 64-token histories run uncompiled: their shapes are not timed, so their compiles
                    # would be warm-up that no timed shape accounts for
                    with decode_batch(eager, st, B, ctx["vocab"], g, HISTORY) as items:
                        measure(f"decode_b{B}", compiled.build(items)[0])
                for T in extends:
                    with prefill_requests(compiled, st, [T], ctx["vocab"], g) as items:
                        measure(f"extend_t{T}", compiled.build(items)[0])
                out["warmup_s"] = sum(w["warmup_s"] for w in warm.values())
                out["counters"] = counts_since(before, dynamo_counts())
                prompts = prompts_for(ctx["vocab"], prompt_lens)
                reference, _ = greedy(eager, st, prompts, args.new_tokens, sync=sync)
                got, _ = greedy(compiled, st, prompts, args.new_tokens, sync=sync)
        finally:
            torch._dynamo.reset()  # the next family compiles from scratch too
        out["tokens_vs_uncompiled"] = compare(reference, got, prompt_lens)
        if "eager_tokens" in ctx:
            out["uncompiled_vs_runtime_eager"] = compare(ctx["eager_tokens"], reference, prompt_lens)
        print(f"  warm-up {out['warmup_s']:.1f} s; {out['counters']['unique_graphs']} graphs, "
              f"{out['counters']['graph_breaks']} graph breaks, {out['counters']['cudagraph_skips']} cudagraph "
              f"skips; tokens vs uncompiled: {out['tokens_vs_uncompiled']['mismatched']} of "
              f"{out['tokens_vs_uncompiled']['tokens']} differ", flush=True)
    stage("torch_compile", compiled_model, needs=["load"])

    vocab = ctx.get("vocab")
    ctx.clear()  # our runtime is done: its graphs and pools go before transformers' model comes
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not get_family(family).transformers_loadable:
        absent = f"transformers has no {family} model"
    elif importlib.util.find_spec("transformers") is None:
        absent = "transformers is not installed"
    else:
        absent = None
        run_transformers(ckpt, args, dev, rec, stage, cell, vocab)
    for name in ("hf_load", "hf_eager", "hf_static", "hf_prefill") if absent else ():
        rec["stages"][name] = {"status": "skipped", "reason": absent}
    rec["targets"] = check_targets(rec)


def run_transformers(ckpt: Path, args, dev: torch.device, rec: dict, stage: Stages, cell, vocab) -> None:
    """transformers' model of the same checkpoint folder: generate (eager, static cache) and prefill."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    sync = synchronizer(dev)
    installed = {f"{name}_installed": importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    out = rec.setdefault("transformers", {"version": transformers.__version__, **installed})
    ctx = {}

    class TokenClock(BaseStreamer):
        """generate hands the prompt, then each new token, to its streamer: the times between are the steps."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def hf_load():
        t0 = time.perf_counter()
        model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                                        output_loading_info=True)
        model = model.to(dev).eval()
        sync()
        out["load_s"] = time.perf_counter() - t0
        out["loading_info"] = {k: sorted(map(str, v))[:10] for k, v in info.items()}
        if info["missing_keys"] or info["mismatched_keys"]:
            raise RuntimeError(f"transformers did not load every tensor: {out['loading_info']}")
        # Which delta-rule kernel the linear layers hold, where the module says (some releases pick
        # it at the first call instead: their fallback warnings land in "kernel_messages").
        kernel = next((m.chunk_gated_delta_rule for m in model.modules() if hasattr(m, "chunk_gated_delta_rule")),
                      None)
        out["chunk_gated_delta_rule"] = f"{kernel.__module__}.{kernel.__name__}" if kernel is not None else None
        ctx["model"] = model
        print(f"  loaded in {out['load_s']:.1f} s; fla installed: {out['fla_installed']}; delta rule "
              f"{out['chunk_gated_delta_rule']}", flush=True)

    def generate(model, ids, **kw) -> tuple[float, TokenClock]:
        clock = TokenClock()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.hf_new_tokens,
                       min_new_tokens=args.hf_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id,
                       streamer=clock, **kw)
        sync()
        return time.perf_counter() - t0, clock

    def hf_generate(column: str, **kw):
        model = ctx["model"]
        g = torch.Generator().manual_seed(4)
        result = out.setdefault(column, {"per_batch": {}})
        before = dynamo_counts()
        for B in args.batch_list:
            ids = torch.randint(2, vocab, (B, HISTORY), generator=g).to(dev)
            first_s, _ = generate(model, ids, **kw)
            steady_s, clock = generate(model, ids, **kw)
            steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
            decode_ms = statistics.median(steps[1:]) * 1e3
            cell(f"decode_b{B}", column, decode_ms)
            result["per_batch"][str(B)] = {"first_call_s": first_s, "steady_call_s": steady_s,
                                           "compile_s": first_s - steady_s, "prefill_ms": steps[0] * 1e3,
                                           "decode_ms": decode_ms}
            print(f"  B={B}: {decode_ms:.3f} ms per token; first call {first_s:.1f} s, steady {steady_s:.2f} s",
                  flush=True)
        result["counters"] = counts_since(before, dynamo_counts())

    def hf_static():
        kw = {"cache_implementation": "static"}
        if dev.type != "cuda":  # generate compiles on accelerators only, unless told to (the dry run on a CPU)
            config = transformers.CompileConfig()
            config._compile_all_devices = True
            kw["compile_config"] = config
        hf_generate("hf_static", **kw)
        out["static_compile_s"] = {B: v["compile_s"] for B, v in out["hf_static"]["per_batch"].items()}

    def hf_prefill():
        """Each extend row's T tokens as a batch of R rows (stage 12 of the docstring: how rows are padded)."""
        model = ctx["model"]
        g = torch.Generator().manual_seed(5)
        pad_id = model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else 0
        batches = out.setdefault("prefill_batches", {})
        for T in args.extend_list:
            for R in (r for r in args.extend_request_list if r <= T):
                lens = split_tokens(T, R)
                width = max(lens)
                ids = torch.full((R, width), pad_id, dtype=torch.long)
                mask = torch.zeros((R, width), dtype=torch.long)
                for row, n in enumerate(lens):  # left padding: each row's tokens end at the last column
                    ids[row, width - n:] = torch.randint(2, vocab, (n,), generator=g)
                    mask[row, width - n:] = 1
                ids = ids.to(dev)
                masked = {"attention_mask": mask.to(dev)} if min(lens) < width else {}
                ms = time_ms(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1, **masked), dev, args.iters,
                             warmup=args.warmup)
                name = step_name("extend", T, R)
                cell(name, "hf_eager", ms)
                batches[name] = {"rows": R, "row_tokens": width, "padding_tokens": R * width - T}
                print(f"  prefill T={T} as {R} rows of {width}: {ms:.3f} ms", flush=True)

    with logged("transformers", "falling back", "fast path", "flash-linear-attention", "causal_conv1d") as messages:
        stage("hf_load", hf_load)
        stage("hf_eager", lambda: hf_generate("hf_eager"), needs=["hf_load"])
        stage("hf_static", hf_static, needs=["hf_load"])
        stage("hf_prefill", hf_prefill, needs=["hf_load"])
    out["kernel_messages"] = messages
    ctx.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def check_targets(rec: dict) -> list[dict]:
    """The issue's targets, each with its measured value (None: not measured) and met / missed."""
    t = rec.get("timings_ms", {})
    rows = {k: parse_step(k) for k in t}
    decodes = sorted((k for k in t if rows[k][0] == "decode"), key=lambda k: rows[k][1])
    extends = sorted((k for k in t if rows[k][0] == "extend" and rows[k][2] == 1), key=lambda k: rows[k][1])
    sizes = sorted({rows[k][1] for k in t if rows[k][0] == "extend"})
    requests = sorted({rows[k][2] for k in t if rows[k][0] == "extend"})
    out = []

    def ratio(step, num, den):
        a, b = t.get(step, {}).get(num), t.get(step, {}).get(den)
        return a / b if a is not None and b else None

    def add(name, values: dict, worst, limit: str, ok):
        """values: per step; the target holds for the worst of them."""
        known = {k: v for k, v in values.items() if v is not None}
        value = worst(known.values()) if known else None
        out.append({"target": name, "value": value, "limit": limit, "met": None if value is None else ok(value),
                    "per_step": known})

    add("decode B=1: eager / full graph", {"decode_b1": ratio("decode_b1", "eager", "full_graph")}, min, ">= 4",
        lambda v: v >= 4)
    add("decode B=1: full graph / floor", {"decode_b1": ratio("decode_b1", "full_graph", "floor")}, max, "<= 1.5",
        lambda v: v <= 1.5)
    add("decode: piecewise / full graph (worst B)", {k: ratio(k, "piecewise", "full_graph") for k in decodes}, max,
        "<= 1.15", lambda v: v <= 1.15)
    longest = extends[-1] if extends else "extend_t2048"
    add(f"extend {longest[len('extend_t'):]}: eager / piecewise", {longest: ratio(longest, "eager", "piecewise")}, min,
        ">= 1.2", lambda v: v >= 1.2)

    def named(T, R, what):
        return f"extend {T}{f' ({R} requests)' if R > 1 else ''}: {what}"
    # The eager gaps: under 5% of the longest extend step and under 10% of the shortest, at every R.
    sizes = sizes or [2048]  # not measured: the targets are still listed
    gap_limits = [(sizes[-1], 0.05)] + ([(sizes[0], 0.10)] if len(sizes) > 1 else [])
    for R in requests or [1]:
        for T, limit in gap_limits:
            step = step_name("extend", T, R)
            gap = rec.get("extend_eager_gaps", {}).get(step[len("extend_t"):], {}).get("fraction")
            add(named(T, R, "eager gaps / step"), {step: gap}, max, f"< {limit}", lambda v, limit=limit: v < limit)
    warm = rec.get("torch_compile", {}).get("warmup_s")
    load_capture = rec.get("load_capture_s")
    add("load+capture / torch.compile warm-up",
        {"start-up": load_capture / warm if load_capture is not None and warm else None}, max, "<= 0.333",
        lambda v: v <= 1 / 3)
    if "transformers" in rec:
        # ours per token as a serving loop pays it (host build + step + argmax read), as generate is timed
        add("decode: transformers static / ours (worst B)", {k: ratio(k, "hf_static", "full_graph_loop")
                                                             for k in decodes}, min, ">= 3", lambda v: v >= 3)
        add("extend: transformers prefill / ours piecewise (worst T)",
            {k: ratio(k, "hf_eager", "piecewise") for k in extends}, min, "> 1", lambda v: v > 1)
        T = sizes[-1]
        for R in requests or [1]:
            step = step_name("extend", T, R)
            add(named(T, R, "transformers prefill / ours piecewise"), {step: ratio(step, "hf_eager", "piecewise")},
                min, ">= 3", lambda v: v >= 3)
    return out


def print_summary(doc: dict) -> None:
    print(f"\n== gpu_e2e on {doc['device']} (torch {doc['torch']}, {doc['date']}) ==")
    if doc.get("copy"):
        print(f"copy bandwidth {doc['copy']['copy_bytes_per_s'] / 1e12:.3f} TB/s (read + written)")
    for family, rec in doc["families"].items():
        print(f"{family} {doc['size']}: " + ", ".join(f"{k} {v['status']}" for k, v in rec.get("stages", {}).items()))
        t = rec.get("timings_ms", {})
        if t:
            print(f"  {'step (ms)':<18}" + "".join(f"{c:>16}" for c in COLUMNS))
            for step, row in t.items():
                print(f"  {step:<18}" + "".join(f"{row[c]:>16.3f}" if c in row else f"{'-':>16}" for c in COLUMNS))
        for name, gaps in rec.get("extend_eager_gaps", {}).items():
            print(f"  eager gaps, extend_t{name}: {gaps['fraction']:.1%} of {gaps['step_ms']:.3f} ms")
        for name, m in rec.get("mixed", {}).items():
            share = "-" if m.get("fraction") is None else f"{m['fraction']:.1%}"
            print(f"  {name}: eager gaps {share}; graphs / (chunk alone + decode alone) {m['graphs_over_alone']:.2f}")
        if "load_capture_s" in rec:
            warm = rec.get("torch_compile", {}).get("warmup_s")
            print(f"  load+capture {rec['load_capture_s']:.2f} s (load {rec['load_s']:.2f}, capture "
                  f"{rec['start']['capture_s']:.2f}, parity {rec['start']['parity_s']:.2f}); torch.compile warm-up "
                  + (f"{warm:.2f} s" if warm is not None else "-"))
        for target in rec.get("targets", []):
            value = f"{target['value']:.3f}" if target["value"] is not None else "-"
            print(f"  target {target['target']} {target['limit']}: {value} {verdict(target['met'], doc['dry_run'])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default=None, help="folder for checkpoints and artifacts (default: a temporary folder outside OUT: a "
                   "bench checkpoint is gigabytes, and what is under OUT travels back)")
    p.add_argument("--families", default="qwen3_next,bailing_linear")
    p.add_argument("--size", help=f"checkpoint size (default {GPU_DEFAULTS['size']}, --dry-run "
                                  f"{DRY_DEFAULTS['size']}); SIZE-hd64: SIZE with attention head_dim 64")
    p.add_argument("--batches", help=f"decode batch sizes (default {GPU_DEFAULTS['batches']})")
    p.add_argument("--extends", help=f"extend token counts (default {GPU_DEFAULTS['extends']})")
    p.add_argument("--extend-requests", default=EXTEND_REQUESTS,
                   help=f"requests each extend step's tokens are split over (default {EXTEND_REQUESTS})")
    p.add_argument("--mixed-tokens", help="token counts of the mixed steps (default: the extend sizes)")
    p.add_argument("--mixed-batches",
                   help=f"decoding requests of each mixed step (default {GPU_DEFAULTS['mixed_batches']})")
    p.add_argument("--iters", type=int, help=f"timed runs per number (default {GPU_DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int,
                   help=f"untimed calls before each timed number (default {GPU_DEFAULTS['warmup']})")
    p.add_argument("--profile-iters", type=int,
                   help=f"profiled calls per profile row (default {GPU_DEFAULTS['profile_iters']})")
    p.add_argument("--new-tokens", type=int, help="greedy tokens per prompt in the token checks")
    p.add_argument("--hf-new-tokens", type=int, help="tokens per transformers generate call")
    p.add_argument("--skip", default="", help="comma-separated stage names not to run (recorded as skipped)")
    p.add_argument("--route", action="append", default=[],
                   help="hgc compile --route for every family's artifact (repeatable), e.g. "
                        "'gdn_core=triton_linear[chunk_impl=triton]'")
    p.add_argument("--compiled-glue", action="store_true",
                   help="build the artifact's compiled bundle (Inductor glue, kernels carried) instead of the traced glue")
    p.add_argument("--keep-caches", action="store_true",
                   help="use the kernel caches the environment points at instead of empty ones (start-up is then warm)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: CPU reference backend, CUDA graphs replaced by reruns (testkit/graph_cases.py)")
    args = p.parse_args(argv)
    for name, value in (DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.extend_list = [int(t) for t in args.extends.split(",")]
    args.extend_request_list = [int(r) for r in args.extend_requests.split(",")]
    args.mixed_token_list = [int(t) for t in args.mixed_tokens.split(",")] if args.mixed_tokens else args.extend_list
    args.mixed_batch_list = [int(b) for b in args.mixed_batches.split(",")]
    args.skip = [s for s in args.skip.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hgc_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    # Cold by default (both start-ups measured as on a new machine); --keep-caches for step timings.
    caches = {} if args.keep_caches else fresh_compile_caches(work / "caches")
    cuda = torch.cuda.is_available() and not args.dry_run
    doc = {"compile_caches": caches, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "transformers": importlib.metadata.version("transformers") if importlib.util.find_spec("transformers")
           else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv),
           "dry_run": args.dry_run, "size": args.size, "batches": args.batch_list, "extends": args.extend_list,
           "extend_requests": args.extend_request_list, "mixed_tokens": args.mixed_token_list,
           "mixed_batches": args.mixed_batch_list, "iters": args.iters, "warmup": args.warmup, "stages": {},
           "families": {}}
    path = out / "gpu_e2e.json"

    def save():
        path.write_text(json.dumps(doc, indent=1, default=str))

    def copy_bandwidth():
        doc["copy"] = device_rates()
    Stages(doc["stages"], skip=args.skip)("copy_bandwidth", copy_bandwidth)
    copy_rate = doc.get("copy", {}).get("copy_bytes_per_s")
    for family in args.families.split(","):
        rec = doc["families"].setdefault(family, {})
        run_guarded(f"{family} {args.size}", rec, lambda: run_family(family, args, work, rec, copy_rate, save))
        save()
    print_summary(doc)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
