"""Start-up and decode of a built artifact (compiled pieces, bundled kernels) against the portable one and transformers.

On the GPU machine (benchmarks/gpu_call.sh installs the wheels; the caches it carries are not
used: every start-up here begins from empty caches):

    python3 benchmarks/serving/startup_bench.py --out $OUT                     # qwen3_next, bench-hd64, bf16
    python3 benchmarks/serving/startup_bench.py --dry-run --out /tmp/startup   # CPU: tiny, cpu target, graphs rerun
    python3 benchmarks/serving/startup_bench.py --out $OUT/fi --route "gqa_attention=flashinfer[decode_impl=flashinfer]"

1. build: `hgc init-model`, `hgc compile --target cuda --dtype bfloat16 --no-inductor` (the portable
   artifact), a copy of it, and `hgc build COPY --device cuda` in a process of its own, timed (what
   building the bundle costs, once per artifact and machine).
2. start, once per variant ("uncompiled": the portable artifact; "compiled": the copy with its
   bundle), each in a fresh process whose kernel caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR,
   FLASHINFER_WORKSPACE_BASE) are new empty folders, so the artifact is all there is:
   load_artifact, a GraphRunner over every recorded bucket up to --max-batch and --max-extend,
   start (capture, then parity). The compiled variant runs inside its bundle's KernelWatch: its
   report says how many kernels were built or tuned, and how many graphs Inductor compiled, at
   start-up (the goal: none of either).
   In the same process, per batch B: B requests with 64-token histories; the full-graph decode
   step (CUDA events, median of --iters); then greedy tokens of a few prompts, which the parent
   compares between the variants; then graph replay against eager steps of the same build:
   --graph-prompts prompts x --graph-tokens greedy tokens each way (32 x 64 on the GPU), the
   tokens that differ, and where they do, the logits' drift before and the eager top-2 gap there
   (bench_common.logit_drift); then the same decode steps through piecewise graphs, on backend
   instances of their own, timed in turns with the full graphs (their ratio: piecewise_over_full);
   last, after every timing, the kernels per step of both (torch.profiler: the kernels of a
   replayed graph are traced one by one), with `launch_check_ms` before and after (bench_common).
3. torch_compile: in a fresh process with empty caches too, the same model from models/ on the
   same backends and pools, `torch.compile(mode="reduce-overhead", dynamic=False)` (as
   benchmarks/serving/gpu_e2e.py compiles it): its load, and for every bucket the compiled variant
   captured (each decode batch; each extend token count, one request) its first three calls minus
   three steady calls: the warm-up it needs before serving the shapes our start-up makes ready.
   The issue's ratio is ours (load + capture + parity) over its load + warm-up.
4. transformers: `generate` of the same checkpoint with `cache_implementation="static"` (its
   compiled decode) per batch, per-token decode ms (benchmarks/gpu_e2e.run_transformers).

One JSON document (OUT/startup_bench.json) and a table on stdout: start-up seconds per variant,
decode ms and kernels per step per batch for compiled, uncompiled and transformers.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import (Stages, compare, decode_batch, host_profile, profile_call, prompts_for,  # noqa: E402
                          host_speed_ms, launch_check_ms, replay_host_split, synchronizer, time_ms)
from compiler.splitops.registry import STATE_DTYPES  # noqa: E402

PAGE = 16
HISTORY = 64
PROMPT_LENS = (5, 17, 40, 64)
VARIANTS = ("uncompiled", "compiled")
GPU_DEFAULTS = dict(size="bench-hd64", batches="1,8,32,128", iters=30, new_tokens=16, hf_new_tokens=32,
                    max_batch=256, max_extend=4096, graph_prompts=32, graph_tokens=64)
DRY_DEFAULTS = dict(size="tiny", batches="1,2", iters=2, new_tokens=4, hf_new_tokens=4, max_batch=2, max_extend=64,
                    graph_prompts=2, graph_tokens=4)
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")


def hgc_process(*argv: str, env: dict) -> float:
    """`hgc ...` in its own process, its progress on our stderr as it goes; the seconds it took."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hgc", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hgc {argv[0]} failed with exit code {proc.returncode} (its stderr is above)")
    return time.perf_counter() - t0


def empty_caches(folder: Path) -> dict:
    """The kernel cache variables pointed at new empty folders under `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    out = {}
    for variable in CACHE_VARIABLES:
        (folder / variable.lower()).mkdir(parents=True)
        out[variable] = str(folder / variable.lower())
    return out


# -- the child: one variant's start-up and decode, in a fresh process ---------------------------------


@contextlib.contextmanager
def load_phases(into: dict):
    """Seconds spent in each step of load_artifact (runtime/artifact/loader.py), summed over calls: the
    loader's own functions wrapped with timers for the duration of the block. The weights are read
    on a thread while the programs load, so their seconds overlap."""
    import runtime.artifact.loader as loader

    steps = {"programs": "load_programs", "weights": "read_weights", "bundle": "open_bundle"}
    originals = {name: getattr(loader, name) for name in steps.values()}

    def timed(phase, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into[phase] = into.get(phase, 0.0) + time.perf_counter() - t
        return call

    for phase, name in steps.items():
        setattr(loader, name, timed(phase, originals[name]))
    try:
        yield into
    finally:
        for name, fn in originals.items():
            setattr(loader, name, fn)


@contextlib.contextmanager
def profiled(path):
    """cProfile around the block (the start-up variant's whole run), its top functions by cumulative
    and by own time written to `path`; nothing when `path` is falsy. The profiler slows Python
    several-fold: the numbers of a profiled run say where the time goes, not how long it takes."""
    if not path:
        yield
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(250)
        stats.sort_stats("tottime").print_stats(80)
        Path(path).write_text(text.getvalue().replace(f"{ROOT}/", ""))  # the repo's files by their paths in it


def run_variant(args) -> dict:
    """Step 2 for the artifact at args.child (this process starts with empty kernel caches)."""
    from runtime.artifact.bundle import CompiledOptions
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.artifact.loader import load_artifact
    from testkit.graph_cases import RerunGraphs, greedy

    dev = torch.device("cpu" if args.dry_run else "cuda")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    rec: dict = {"variant": args.variant}
    t0 = time.perf_counter()
    with load_phases(rec.setdefault("load_phases_s", {})):
        # the main program alone, as `hgc run` without --speculative-tokens loads it (--all-programs:
        # every program, as a run with drafts does)
        art = load_artifact(args.child, dev, compiled=CompiledOptions(enabled=args.variant == "compiled",
                                                                      allow_builds=args.allow_kernel_builds),
                            programs=None if args.all_programs else ("main",))
    phases = rec["load_phases_s"]
    mark = time.perf_counter()
    phases["load_artifact"] = mark - t0  # programs, weights and bundle are parts of it
    if args.variant == "compiled" and art.compiled is None:
        raise RuntimeError(f"{args.child} has no bundle for this machine")
    recorded = art.manifest["buckets"]
    decode = tuple(b for b in recorded["decode_batch_sizes"] if b <= args.max_batch)
    extend = tuple(t for t in recorded["extend_token_counts"] if t <= args.max_extend) or (args.max_extend,)
    graph_lens = graph_prompt_lens(args.graph_prompts)
    longest = max(max(PROMPT_LENS) + args.new_tokens, max(graph_lens) + args.graph_tokens)
    max_len = -(-max(max(extend), HISTORY + 1, longest) // PAGE) * PAGE
    kv, st = make_pools(art.registry, max_len, max(decode), page_size=PAGE, device=dev,
                        kv_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    phases["pools"], mark = time.perf_counter() - mark, time.perf_counter()
    ops = art.backends(kv, st).op_table("main")
    phases["backends"], mark = time.perf_counter() - mark, time.perf_counter()
    runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=decode, extend_buckets=extend,
                         max_pages_per_seq=max_len // PAGE, extend_max_seqs=min(16, min(extend)),
                         graphs=RerunGraphs() if args.dry_run else None)
    sync()
    phases["runner"] = time.perf_counter() - mark
    rec["load_s"] = time.perf_counter() - t0
    vocab = int(art.manifest["model"]["vocab_size"])
    marks = [time.perf_counter()]

    def log(line):
        marks.append(time.perf_counter())
        print(f"  {line}", flush=True)

    with art.compiled.watch() if art.compiled is not None else contextlib.nullcontext():
        rec["parity"] = runner.start(vocab, log=log)
    sync()
    rec.update(capture_s=marks[1] - marks[0], parity_s=marks[-1] - marks[1], keys=[str(k) for k in runner.keys],
               parity_s_per_key=runner.parity.seconds, parity_phases_per_key=runner.parity.phases)
    rec["load_capture_parity_s"] = rec["load_s"] + marks[-1] - marks[0]
    # whether the start-up imported FLA (about a second of Python where no layer runs its kernels)
    rec["fla_imported"] = any(name == "fla" or name.startswith("fla.") for name in sys.modules)
    if art.compiled is not None:
        art.compiled.parity = list(runner.parity.compiled.values())
        rec["bundle"] = art.compiled.report()
    if args.profile:
        # The profile is of the start-up; the decode timings below run profilers of their own, which
        # cannot run inside this one (Python 3.12: "another profiling tool is already active").
        return rec
    g = torch.Generator().manual_seed(2)
    batches = [B for B in args.batch_list if B <= max(decode)]
    rec["launch_check_ms"] = {"before_timings": launch_check_ms(dev)}
    for B in batches:
        with decode_batch(runner, st, B, vocab, g, HISTORY) as items:
            step, key = runner.build(items)
            cell = rec.setdefault("decode", {}).setdefault(str(B), {"key": str(key)})
            cell["host_speed_ms"] = host_speed_ms()
            cell["step_ms"] = time_ms(lambda: runner.run(step, key), dev, args.iters)
            if dev.type == "cuda" and key in runner._full_graphs:
                cell["host_split_ms"] = replay_host_split(runner, step, key)
            host = host_profile(lambda: runner.run(step, key), 20, top=20, sync=synchronizer(dev))
            cell.update(host_top_cum=host["top_cum"], host_top_own=host["top_own"])
        print(f"  decode B={B}: {cell['step_ms']:.3f} ms ({key}), host {cell.get('host_split_ms', 'n/a')}", flush=True)
    prompts = prompts_for(vocab, PROMPT_LENS[: max(decode)])
    rec["tokens"], _ = greedy(runner, st, prompts, args.new_tokens, sync=sync)
    rec["prompt_lens"] = [len(p) for p in prompts]
    if "graph_tokens" not in args.skip:
        rec["tokens_graph_vs_eager"] = graph_vs_eager(runner, st, vocab, graph_lens, args.graph_tokens, sync)
    piecewise = None
    if "piecewise" not in args.skip:
        piecewise = time_piecewise(args, art, runner, kv, st, dev, decode, extend, max_len, rec, g)
    rec["launch_check_ms"]["after_timings"] = launch_check_ms(dev)
    if dev.type == "cuda":
        # Last: a torch.profiler session can leave CUPTI slowing every launch after it (bench_common,
        # TEARDOWN_CUPTI), so no timing above runs after one.
        profile_kernels(runner, piecewise, st, vocab, batches, dev, rec, g)
        rec["launch_check_ms"]["after_profiles"] = launch_check_ms(dev)
    return rec


def profile_kernels(full, piecewise, st, vocab, batches, dev, rec, g) -> None:
    """The kernels per step (torch.profiler: a replayed graph's kernels are traced one by one) of
    the full-graph and the piecewise decode steps timed before: at B=1, where launches rather than
    bytes set the time, every kernel in order and the driver calls under the step; elsewhere the
    top 8."""
    for B in batches:
        cell = rec["decode"][str(B)]
        with decode_batch(full, st, B, vocab, g, HISTORY) as items:
            step, key = full.build(items)
            prof = profile_call(lambda: full.run(step, key), dev, top=1000)
            cell.update(kernels_per_step=prof["kernels_per_call"], kernel_ms=prof["kernel_ms"],
                        host_issue_ms=prof["host_issue_ms"], top_kernels=prof["top_kernels"][:1000 if B == 1 else 8],
                        device_span_ms=prof["device_span_ms"], device_idle_ms=prof["device_idle_ms"])
            if B == 1:
                cell.update(kernel_sequence=prof["kernel_sequence"], top_host_ops=prof["top_host_ops"],
                            longest_gaps=prof["longest_gaps"])
            if piecewise is not None:
                step, key = piecewise.build(items)
                prof = profile_call(lambda: piecewise.run(step, key), dev, top=30)
                cell.update(piecewise_kernels_per_step=prof["kernels_per_call"], piecewise_kernel_ms=prof["kernel_ms"],
                            piecewise_host_issue_ms=prof["host_issue_ms"], piecewise_device_span_ms=prof["device_span_ms"],
                            piecewise_device_idle_ms=prof["device_idle_ms"])
                if B == 1:
                    cell.update(piecewise_longest_gaps=prof["longest_gaps"], piecewise_top_host_ops=prof["top_host_ops"])
        print(f"  decode B={B}: {cell['kernels_per_step']} kernels, {cell['kernel_ms']:.3f} ms of them "
              f"({cell['host_issue_ms']:.3f} ms to issue; device idle {cell['device_idle_ms']:.3f} ms between them)"
              + (f"; piecewise {cell['piecewise_kernels_per_step']} kernels, {cell['piecewise_kernel_ms']:.3f} ms, "
                 f"{cell['piecewise_host_issue_ms']:.3f} ms to issue, device idle "
                 f"{cell['piecewise_device_idle_ms']:.3f} ms" if piecewise is not None else ""), flush=True)


def run_torch_compile(args) -> dict:
    """Step 3 for the checkpoint at args.ckpt, over the backends of the artifact at args.child."""
    from gpu_e2e import FIRST_CALLS, EagerModel, first_calls_s, prefill_requests

    from models.loader import load_checkpoint
    from runtime.artifact.bundle import CompiledOptions
    from runtime.engine.generate import make_pools
    from runtime.artifact.loader import load_artifact

    dev = torch.device("cpu" if args.dry_run else "cuda")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    art = load_artifact(args.child, dev, compiled=CompiledOptions(enabled=False))  # its backends, not its graph
    _, _, model = load_checkpoint(args.ckpt, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                  device=dev)
    recorded = art.manifest["buckets"]
    decode = [b for b in recorded["decode_batch_sizes"] if b <= args.max_batch]
    extend = [] if args.dry_run else [t for t in recorded["extend_token_counts"] if t <= args.max_extend]
    max_len = -(-max([*extend, HISTORY + 1]) // PAGE) * PAGE
    kv, st = make_pools(art.registry, max_len, max(decode), page_size=PAGE, device=dev,
                        kv_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    ops = art.backends(kv, st).op_table("main")
    model.set_ops(ops)
    chunk = max(extend, default=HISTORY)
    eager = EagerModel(model, ops, kv, max_len // PAGE, dev, chunk)  # the histories: shapes nobody times
    compiled = EagerModel(torch.compile(model, mode="reduce-overhead", dynamic=False), ops, kv, max_len // PAGE,
                          dev, chunk)
    sync()
    rec: dict = {"variant": "torch_compile", "load_s": time.perf_counter() - t0, "shapes": {}}
    vocab = int(art.manifest["model"]["vocab_size"])
    g = torch.Generator().manual_seed(2)

    def warm(name: str, step) -> None:
        first = first_calls_s(lambda: compiled.run(step), sync)
        steady = time_ms(lambda: compiled.run(step), dev, 3)
        rec["shapes"][name] = {"first_calls_s": first, "steady_ms": steady,
                               "warmup_s": sum(first) - FIRST_CALLS * steady / 1e3}
        print(f"  torch.compile {name}: first calls {', '.join(f'{x:.2f}' for x in first)} s, then "
              f"{steady:.3f} ms", flush=True)

    try:
        for B in decode:
            with decode_batch(eager, st, B, vocab, g, HISTORY) as items:
                warm(f"decode_b{B}", compiled.build(items)[0])
        for T in extend:
            with prefill_requests(compiled, st, [T], vocab, g) as items:
                warm(f"extend_t{T}", compiled.build(items)[0])
    finally:
        torch._dynamo.reset()
    rec["warmup_s"] = sum(c["warmup_s"] for c in rec["shapes"].values())
    rec["load_and_warmup_s"] = rec["load_s"] + rec["warmup_s"]
    return rec


def graph_prompt_lens(n: int) -> list[int]:
    """n prompt lengths spread from 5 to 64 tokens."""
    return [5 + (59 * i) // max(n - 1, 1) for i in range(n)]


def graph_vs_eager(runner, st, vocab: int, lens: list[int], new_tokens: int, sync) -> dict:
    """The issue's token check of one build: greedy tokens with every step eager, then with the
    captured graphs (prefills of more requests than an extend bucket holds run eagerly in both),
    compared; the logits' drift shows whether a difference is rounding or a fault."""
    from bench_common import key_names, logit_drift
    from testkit.graph_cases import greedy

    prompts = prompts_for(vocab, lens, seed=3)
    eager_logits, graph_logits = [], []
    eager, _ = greedy(runner, st, prompts, new_tokens, sync=sync, eager=True, logits=eager_logits)
    graphs, keys = greedy(runner, st, prompts, new_tokens, sync=sync, logits=graph_logits)
    out = {**compare(eager, graphs, lens), "keys": key_names(keys),
           **logit_drift(eager_logits, graph_logits, eager, graphs)}
    print(f"  graphs vs eager: {out['mismatched']} of {out['tokens']} tokens differ ({len(prompts)} prompts x "
          f"{new_tokens}); replayed keys {out['keys']}", flush=True)
    return out


def time_piecewise(args, art, full, kv, st, dev, decode, extend, max_len, rec, g):
    """The same decode steps through piecewise graphs (the extend plan's captured pieces with its
    eager gaps) against the full graphs of `full`, timed in turns: the issue's piecewise against
    full-graph ratio. A piecewise step at small batch is bound by the host, and a lent machine's
    host speed drifts within a call, so each round times both runners back to back and the ratio is
    taken from those rounds. The piecewise runner has backend instances of its own (their own
    static buffers, over the same pools), so the full runner's graphs stay valid beside it.
    Returns that runner (profile_kernels profiles its steps after every timing)."""
    from runtime.backends.kernels.launch_cache import Launcher
    from runtime.graphs.runner import GraphRunner
    from testkit.graph_cases import RerunGraphs

    ops = art.backends(kv, st).op_table("main")
    runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=decode, extend_buckets=(min(extend),),
                         max_pages_per_seq=max_len // PAGE, extend_max_seqs=min(16, min(extend)),
                         graphs=RerunGraphs() if args.dry_run else None, decode_graphs="piecewise")
    runner.capture()
    vocab = int(art.manifest["model"]["vocab_size"])
    for B in args.batch_list:
        if B > max(decode):
            continue
        with decode_batch(runner, st, B, vocab, g, HISTORY) as items:
            step, key = runner.build(items)
            full_step, full_key = full.build(items)
            cell = rec["decode"][str(B)]
            cell["piecewise_host_speed_ms"] = host_speed_ms()  # against host_speed_ms: the same host?
            # full graph, and piecewise with and without the Triton launch cache
            # (runtime/backends/kernels/launch_cache.py), in turns
            times = {"full": [], True: [], False: []}
            for _ in range(3):
                times["full"].append(time_ms(lambda: full.run(full_step, full_key), dev, args.iters))
                for enabled in (True, False):
                    Launcher.enabled = enabled
                    times[enabled].append(time_ms(lambda: runner.run(step, key), dev, args.iters))
            Launcher.enabled = True
            cell["piecewise_full_ms"] = statistics.median(times["full"])
            cell["piecewise_ms"] = statistics.median(times[True])
            cell["piecewise_ms_without_launch_cache"] = statistics.median(times[False])
            cell["piecewise_over_full"] = cell["piecewise_ms"] / cell["piecewise_full_ms"]
            # Where a piecewise step's host time goes: the Python functions (the eager gaps' launch
            # paths); its kernels are profiled after every timing (profile_kernels)
            host = host_profile(lambda: runner.run(step, key), 20, top=30, sync=synchronizer(dev))
            cell.update(piecewise_host_top_cum=host["top_cum"], piecewise_host_top_own=host["top_own"])
        print(f"  decode B={B} piecewise: {cell['piecewise_ms']:.3f} ms against {cell['piecewise_full_ms']:.3f} ms "
              f"full in turns ({cell['piecewise_over_full']:.2f}x; {cell['piecewise_ms_without_launch_cache']:.3f} ms "
              f"without the launch cache)", flush=True)
    return runner


# -- the parent ---------------------------------------------------------------------------------


def build_artifacts(args, work: Path, doc: dict, env: dict) -> dict:
    """Step 1: the checkpoint, the portable artifact and a built copy."""
    from bench_common import write_checkpoint_hd64

    ckpt, plain, built = work / "ckpt", work / "art_uncompiled", work / "art_compiled"
    if args.size.endswith("-hd64"):
        write_checkpoint_hd64(args.size[: -len("-hd64")], ckpt, args.family)
    else:
        hgc_process("init-model", "--family", args.family, "--size", args.size, "--seed", "0", "-o", str(ckpt),
                    "--force", env=env)
    target = "cpu" if args.dry_run else "cuda"
    dtype = "float32" if args.dry_run else "bfloat16"
    routes = [arg for route in args.route for arg in ("--route", route)]
    doc["compile_s"] = hgc_process("compile", str(ckpt), "-o", str(plain), "--target", target, "--dtype", dtype,
                                   "--no-dumps", "--no-inductor", "--force", *routes,
                                   *(["--state-dtype", args.state_dtype] if args.state_dtype else []), env=env)
    shutil.rmtree(built, ignore_errors=True)
    shutil.copytree(plain, built)
    build_env = {**env, **empty_caches(work / "caches_build")}
    doc["build_s"] = hgc_process("build", str(built), "--device", target, env=build_env)
    doc["bundle"] = json.loads((built / "manifest.json").read_text()).get("targets")
    return {"ckpt": ckpt, "uncompiled": plain, "compiled": built}


def start_variant(args, variant: str, artifact: Path, work: Path, env: dict) -> dict:
    """Step 2 in a fresh process with empty caches; its JSON."""
    out = work / f"{variant}.json"
    child_env = {**env, **empty_caches(work / f"caches_{variant}")}
    argv = [sys.executable, __file__, "--child", str(artifact), "--variant", variant, "--child-out", str(out),
            "--batches", args.batches, "--iters", str(args.iters), "--new-tokens", str(args.new_tokens),
            "--max-batch", str(args.max_batch), "--max-extend", str(args.max_extend), "--out", str(work),
            "--graph-prompts", str(args.graph_prompts), "--graph-tokens", str(args.graph_tokens),
            "--ckpt", str(work / "ckpt")]
    argv += ["--allow-kernel-builds"] if args.allow_kernel_builds else []
    argv += ["--skip", args.skip] if args.skip else []
    argv += ["--profile"] if args.profile else []
    argv += ["--all-programs"] if args.all_programs else []
    t0 = time.perf_counter()
    proc = subprocess.run(argv + (["--dry-run"] if args.dry_run else []), cwd=ROOT, env=child_env, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the {variant} start-up process failed ({proc.returncode})")
    rec = json.loads(out.read_text())
    rec["process_s"] = time.perf_counter() - t0  # with Python and torch imports: what a user waits
    if args.profile:
        shutil.copy(work / f"profile_{variant}.txt", Path(args.out) / f"profile_{variant}.txt")
    return rec


def table(doc: dict) -> str:
    rows = [f"{'':24s}" + "".join(f"{v:>16s}" for v in (*VARIANTS, "hf_static"))]
    v = doc.get("variants", {})
    rows.append(f"{'load+capture+parity s':24s}" + "".join(
        f"{v.get(n, {}).get('load_capture_parity_s', float('nan')):16.2f}" for n in VARIANTS))
    hf = doc.get("transformers", {}).get("hf_static", {}).get("per_batch", {})
    for B in doc["batches"]:
        ms = [v.get(n, {}).get("decode", {}).get(str(B), {}).get("step_ms", float("nan")) for n in VARIANTS]
        kernels = [v.get(n, {}).get("decode", {}).get(str(B), {}).get("kernels_per_step") for n in VARIANTS]
        rows.append(f"{f'decode B={B} ms':24s}" + "".join(f"{m:16.3f}" for m in ms)
                    + f"{hf.get(str(B), {}).get('decode_ms', float('nan')):16.3f}")
        rows.append(f"{f'decode B={B} kernels':24s}" + "".join(f"{k if k is not None else 'n/a':>16}" for k in kernels))
        piecewise = [v.get(n, {}).get("decode", {}).get(str(B), {}).get("piecewise_ms", float("nan")) for n in VARIANTS]
        rows.append(f"{f'decode B={B} piecewise':24s}" + "".join(f"{m:16.3f}" for m in piecewise))
    differ = [v.get(n, {}).get("tokens_graph_vs_eager") for n in VARIANTS]
    cells = [f"{t['mismatched']} of {t['tokens']}" if t else "n/a" for t in differ]
    rows.append(f"{'graph vs eager differ':24s}" + "".join(f"{c:>16}" for c in cells))
    tc = v.get("torch_compile")
    if tc:
        rows.append(f"torch.compile: load {tc['load_s']:.2f} s + warm-up {tc['warmup_s']:.2f} s over "
                    f"{len(tc['shapes'])} shapes; compiled start-up over it: "
                    f"{doc.get('startup_over_torch_compile', float('nan')):.2f} (goal <= 0.33)")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default=None, help="folder for the checkpoint and artifacts (default: a temporary one)")
    p.add_argument("--family", default="qwen3_next")
    p.add_argument("--size", help=f"default {GPU_DEFAULTS['size']} ({DRY_DEFAULTS['size']} with --dry-run)")
    p.add_argument("--batches", help="decode batch sizes, e.g. 1,8,32,128")
    p.add_argument("--iters", type=int)
    p.add_argument("--new-tokens", type=int, help="greedy tokens per prompt in the token comparison")
    p.add_argument("--hf-new-tokens", type=int, help="tokens per transformers generate call")
    p.add_argument("--graph-prompts", type=int, help="prompts of the graph-against-eager token check (GPU: 32)")
    p.add_argument("--graph-tokens", type=int, help="greedy tokens per prompt in that check (GPU: 64)")
    p.add_argument("--max-batch", type=int, help="largest decode bucket captured (default: 256, every recorded one)")
    p.add_argument("--max-extend", type=int, help="largest extend bucket captured (default: 4096)")
    p.add_argument("--skip", default="", help="comma-separated stages not to run: build, uncompiled, compiled, "
                                              "torch_compile, transformers; piecewise skips the piecewise decode "
                                              "timing, "
                                              "graph_tokens the graph-against-eager token check")
    p.add_argument("--reuse", action="store_true",
                   help="use the checkpoint and artifacts an earlier call built under --work (split a run across "
                        "calls with a time limit: build and start-ups in one, --reuse --skip uncompiled,compiled in "
                        "the next for transformers)")
    p.add_argument("--allow-kernel-builds", action="store_true",
                   help="let the compiled start-up build what its bundle lacks (counted in its report) instead of "
                        "refusing, so the decode numbers are taken either way")
    p.add_argument("--profile", action="store_true",
                   help="run each start-up variant under cProfile and write OUT/profile_VARIANT.txt (its timings "
                        "are then the profiler's, several-fold slower: use it to see where time goes); the "
                        "variant stops after its start-up: no decode timings, token checks or piecewise steps")
    p.add_argument("--all-programs", action="store_true",
                   help="start-ups load every program of the artifact (the draft's too, as a run with "
                        "--speculative-tokens does) instead of the main program alone; compare the two in one call "
                        "(--reuse), since lent machines differ in host speed")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, cpu target, CUDA graphs rerun")
    p.add_argument("--route", action="append", default=[],
                   help="passed to hgc compile --route (repeatable), e.g. 'gqa_attention=flashinfer[decode_impl=flashinfer]'; "
                        "use another --work (or no --reuse) for each set of routes")
    p.add_argument("--state-dtype", default=None, choices=STATE_DTYPES,
                   help="passed to hgc compile --state-dtype: what the linear layers keep their recurrent states "
                        "in (default: the checkpoint's, as hgc compile decides; another --work, or no --reuse, "
                        "for each)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in (DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.extend_list = []  # run_transformers' prefill stage is not run here
    if args.dry_run and "transformers" not in args.skip:  # inductor on a CPU takes minutes for generate's compile
        args.skip = ",".join(filter(None, [args.skip, "transformers"]))
    if args.child:
        with torch.no_grad(), profiled(args.profile and Path(args.out) / f"profile_{args.variant}.txt"):
            rec = run_torch_compile(args) if args.variant == "torch_compile" else run_variant(args)
        Path(args.child_out).write_text(json.dumps(rec, default=str))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hgc_startup_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HGC_HOME=str(work / "hgc_home"), PYTHONUNBUFFERED="1")
    cuda = torch.cuda.is_available() and not args.dry_run
    doc = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "dry_run": args.dry_run, "size": args.size,
           "family": args.family, "routes": args.route, "state_dtype": args.state_dtype,
           "all_programs": args.all_programs, "batches": args.batch_list,
           "iters": args.iters, "stages": {}, "variants": {}}
    path = out / "startup_bench.json"
    save = lambda: path.write_text(json.dumps(doc, indent=1, default=str))  # noqa: E731
    stage = Stages(doc["stages"], skip=[s for s in args.skip.split(",") if s], save=save)
    arts: dict = {}
    built = {"ckpt": work / "ckpt", "uncompiled": work / "art_uncompiled", "compiled": work / "art_compiled"}
    if args.reuse and all((built[v] / "manifest.json").is_file() for v in VARIANTS):
        arts.update(built)  # an earlier call's build (--work names its folder): start-up and decode only
        doc["reused_build"] = str(work)
        doc["stages"]["build"] = {"status": "ok", "reused": True}
    else:
        stage("build", lambda: arts.update(build_artifacts(args, work, doc, env)))
    for variant in VARIANTS:
        stage(variant, lambda v=variant: doc["variants"].__setitem__(v, start_variant(args, v, arts[v], work, env)),
              needs=["build"])
    if all(doc["stages"].get(v, {}).get("status") == "ok" for v in VARIANTS):
        a, b = (doc["variants"][v] for v in VARIANTS)
        doc["tokens_compiled_vs_uncompiled"] = compare(a["tokens"], b["tokens"], a["prompt_lens"])
    stage("torch_compile", lambda: doc["variants"].__setitem__(
        "torch_compile", start_variant(args, "torch_compile", arts["uncompiled"], work, env)), needs=["build"])
    ours, theirs = (doc["variants"].get(v, {}) for v in ("compiled", "torch_compile"))
    if "load_capture_parity_s" in ours and "load_and_warmup_s" in theirs:  # the issue's goal: at most 1/3
        doc["startup_over_torch_compile"] = ours["load_capture_parity_s"] / theirs["load_and_warmup_s"]

    def transformers_stage():
        from gpu_e2e import run_transformers

        cells: dict = {}
        vocab = int(json.loads((arts["ckpt"] / "config.json").read_text())["vocab_size"])
        run_transformers(arts["ckpt"], args, torch.device("cuda" if cuda else "cpu"), doc,
                         Stages(doc.setdefault("transformers_stages", {}), skip=["hf_eager", "hf_prefill"]),
                         lambda step, column, value: cells.setdefault(step, {}).__setitem__(column, value), vocab)

    stage("transformers", transformers_stage, needs=["build"])
    save()
    print(table(doc))
    print(json.dumps(summary(doc)))
    print(f"JSON: {path}")
    return 0


def summary(doc: dict) -> dict:
    """The numbers the issue asks for, one line: start-up, decode ms and kernels per step, per variant."""
    def variant(rec: dict) -> dict:
        return {"load_capture_parity_s": rec.get("load_capture_parity_s"), "process_s": rec.get("process_s"),
                "kernels_built_at_start_up": rec.get("bundle", {}).get("kernel_builds"),
                "inductor_compiles_at_start_up": rec.get("bundle", {}).get("inductor_compiles"),
                "decode": {B: {k: c.get(k) for k in ("step_ms", "kernels_per_step", "piecewise_ms")}
                           for B, c in rec.get("decode", {}).items()},
                "graph_vs_eager_mismatched": (rec.get("tokens_graph_vs_eager") or {}).get("mismatched")}

    hf = doc.get("transformers", {}).get("hf_static", {}).get("per_batch", {})
    return {"device": doc["device"], "build_s": doc.get("build_s"),
            "variants": {v: variant(doc["variants"][v]) for v in VARIANTS if v in doc["variants"]},
            "hf_static_decode_ms": {B: c.get("decode_ms") for B, c in hf.items()},
            "torch_compile_load_and_warmup_s": doc["variants"].get("torch_compile", {}).get("load_and_warmup_s"),
            "startup_over_torch_compile": doc.get("startup_over_torch_compile"),
            "tokens_compiled_vs_uncompiled": doc.get("tokens_compiled_vs_uncompiled")}


if __name__ == "__main__":
    sys.exit(main())
