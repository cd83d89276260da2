"""Helpers shared by the GPU benchmark scripts.

- `is_cuda`, `device_facts`, `device_rates`, `rel_err`, `ensure_einops`, `run_gpu_pytest`, `fmt`:
  what every kernel benchmark needs; `device_rates` is the denominator of every floor.

- `Stages`: runs named stages, records ok / error / seconds, never lets one failure stop a script;
  `run_guarded`: the same for a whole run (a family, a size) around its stages.
- `write_checkpoint_hd64`: a checkpoint of a size with attention head_dim 64 (FlashInfer's smallest).
- `prompts_for`, `key_names`, `compare`: prompts, the keys a run used, and how two runs' greedy tokens differ (the tokens themselves:
  testkit/graph_cases.greedy, which the tests use too); `logit_drift`: whether differing tokens are rounding or a fault.
- `decode_batch`: B requests with a history, and their next decode step's items.
- `time_ms`: median milliseconds between CUDA events (perf_counter on the CPU), each call from an idle
  device; `back_to_back_ms`: a call's share of many queued without waiting; `launch_check_ms`:
  the host cost of a small graph's replay, which says whether a profiler slowed the timings after it;
  `profile_call` and its `device_gaps`: a call's kernels, host ops and the device's waits (profiler);
  `request_timeline`: the same for one request to its first token, the host's share before the device starts.
- `engine_script`: the main of a benchmark over one engine-level model (prefix_bench, spec_bench):
  the shared flags, GPU or dry-run defaults, OUT/NAME.json saved after every stage, a table last.

A "runner" here is anything with `build(items) -> (step, key)`, `run(step, key) -> logits`,
`kv_pool` and `max_pages`: a GraphRunner, or gpu_e2e.py's eager family model.
"""

from __future__ import annotations

import argparse
import hashlib
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

# Kineto leaves CUPTI subscribed after a torch.profiler session unless told to tear it down, and a
# subscribed CUPTI slows every later CUDA launch of the process: a 220-kernel graph's replay()
# went from 0.004 to 0.05 ms of host time after one profile (graph_launch_probe, "after a
# profile"). Every timing a bench takes after profiling would carry that, so benches tear it
# down; `launch_check_ms` records whether that held in a run.
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from runtime.cache.batch import SeqState, build_step, commit_step

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # A dry run's kernels under Triton's interpreter: patched as in the test suite's processes, so they
    # compute what the kernel tests check, in about half the time (testkit/triton_interpreter.py). A
    # machine without pytest (which testkit's module imports) runs the interpreter as Triton ships it.
    try:
        from testkit.triton_interpreter import install_interpreter_patches
    except ImportError:
        pass
    else:
        install_interpreter_patches()

__all__ = ["is_cuda", "device_facts", "device_rates", "run_gpu_pytest", "fmt", "rel_err", "profile_call", "ensure_einops", "Stages", "run_guarded", "write_checkpoint_hd64", "prompts_for", "key_names", "compare", "decode_batch", "time_ms", "back_to_back_ms",
           "synchronizer", "host_profile", "engine_script", "target_rows", "verdict", "compiled_artifact", "release_config", "load_format", "host_speed_ms",
           "launch_check_ms", "device_gaps", "replay_host_split"]


def is_cuda() -> bool:
    """A CUDA device that runs compiled kernels (not Triton's CPU interpreter)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _device_events(fn, reps: int) -> list:
    """The profiler's averaged device events (kernels, memsets, copies) of `reps` calls of fn, one
    warm-up call first, outside the profile. CUDA only."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.self_device_time_total > 0]


def device_ms_by_kernel(fn, reps: int = 20) -> dict[str, float]:
    """Milliseconds of GPU time per call of fn, by kernel name (the profiler's self device time),
    largest first; {} off the GPU."""
    if not is_cuda():
        return {}
    split: dict[str, float] = {}
    for e in _device_events(fn, reps):
        split[e.key] = split.get(e.key, 0.0) + e.self_device_time_total / 1e3 / reps
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


def kernels_per_call(fn, reps: int = 10) -> float | None:
    """Device kernels (and memsets, copies) one call of fn launches; None off the GPU."""
    if not is_cuda():
        return None
    return sum(e.count for e in _device_events(fn, reps)) / reps


def device_facts(dry: bool) -> dict:
    """Versions, date and the card of a run (on the CPU: placeholders a dry run can use)."""
    import triton
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "dry_run": dry, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if is_cuda():
        prop = torch.cuda.get_device_properties(0)
        env.update(device=prop.name, sms=prop.multi_processor_count,
                   l2_bytes=int(getattr(prop, "L2_cache_size", 50 << 20)), memory_bytes=prop.total_memory)
    else:
        env.update(device="cpu (Triton interpreter)", sms=None, l2_bytes=50 << 20, memory_bytes=None)
    return env


def device_rates() -> dict:
    """The ceilings floors are measured against, in this run: device-to-device copy rate (bytes
    read plus written, 1 GiB each way: far past the L2) and the bf16 matmul rate (8192^3), as
    triton's do_bench medians. On the CPU a small memcpy and matmul stand in (dry runs only)."""
    if not is_cuda():
        n, m = 16 << 20, 256
        src, dst = torch.randn(n // 4), torch.empty(n // 4)
        a = torch.randn(m, m)
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        a @ a
        t2 = time.perf_counter()
        return {"copy_bytes_per_s": 2 * n / (t1 - t0), "matmul_flops_per_s": 2 * m ** 3 / (t2 - t1),
                "method": "cpu memcpy and float32 matmul (dry run)"}
    from triton.testing import do_bench
    n, m = 1 << 30, 8192
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    src = dst = None  # 2 GiB back to the allocator before the kernels run
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    a = b = None
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / (copy_ms * 1e-3), "matmul_flops_per_s": 2 * m ** 3 / (mm_ms * 1e-3),
            "method": "do_bench medians: 1 GiB copy_ (read + write), 8192^3 bf16 matmul"}


def run_gpu_pytest(test_file: str, timeout: float, log_path: Path) -> dict:
    """`pytest -m gpu TEST_FILE` in a subprocess from the repository root, its output to log_path:
    {"rc", "summary" (the last line), "tail"}; rc "timeout" when it ran past `timeout` seconds."""
    if timeout < 20:
        return {"error": "skipped: time budget"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", test_file]
    print(f"{' '.join(cmd[1:])} (timeout {timeout:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              cwd=str(Path(__file__).resolve().parents[1]))
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")), "timeout"
    log_path.write_text(output)
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return {"rc": rc, "summary": lines[-1] if lines else "", "tail": output[-3000:]}


def fmt(v, spec=".1f", none="n/a") -> str:
    """A number for a table, or `none` where it was not measured (None or NaN)."""
    return none if v is None or v != v else format(v, spec)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (float32 with torch's blocked sums: ample for 1e-4 checks of 1e8 elements)."""
    x, ref = x.float().cpu(), ref.float().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def ensure_einops() -> str | None:
    """FLA's ops packages import einops for their naive reference functions only (never called
    here). If the machine lacks it, a stub that refuses every call lets the kernels import."""
    try:
        __import__("einops")
        return None
    except ImportError:
        def refuse(*args, **kwargs):
            raise NotImplementedError("einops is not installed; this stub only lets fla import")
        stub = types.ModuleType("einops")
        stub.rearrange = stub.repeat = stub.reduce = stub.einsum = refuse
        sys.modules["einops"] = stub
        return "einops missing: stubbed (only FLA's naive reference functions use it)"


class Stages:
    """Runs named stages, records ok / error / seconds, and never lets one failure stop the script.

    A stage named in `skip` is recorded as skipped; so is one whose `needs` did not end ok.
    `save()`, if given, runs after every stage: a run cut off by its time limit still leaves what
    its finished stages measured."""

    def __init__(self, record: dict, skip=(), save=None):
        self.record = record
        self.skip = set(skip)
        self.save = save or (lambda: None)

    def __call__(self, name, fn, *args, needs=()):
        missing = [n for n in needs if self.record.get(n, {}).get("status") != "ok"]
        if name in self.skip or missing:
            reason = "--skip" if name in self.skip else f"needs {missing}"
            self.record[name] = {"status": "skipped", "reason": reason}
            print(f"[{name}] skipped: {reason}", flush=True)
            return None
        print(f"[{name}] ...", flush=True)
        t0 = time.perf_counter()
        try:
            out = fn(*args)
            self.record[name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 3)}
            print(f"[{name}] ok in {time.perf_counter() - t0:.2f} s", flush=True)
            return out
        except Exception as e:  # report and continue: the later stages still tell something
            tb = traceback.format_exc()
            print(f"[{name}] FAILED: {type(e).__name__}: {e}\n{tb}", flush=True)
            self.record[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                                 "traceback": tb[-4000:], "seconds": round(time.perf_counter() - t0, 3)}
            return None
        finally:
            self.save()


def run_guarded(label: str, rec: dict, fn) -> None:
    """One whole run of a script (a family, a size) under no_grad: an error that escapes its
    Stages is a bug in the script itself, recorded as rec["fatal"] so the other runs still go."""
    print(f"=== {label} ===", flush=True)
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001 - keep the other runs
        rec["fatal"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    if is_cuda():
        torch.cuda.empty_cache()


def write_checkpoint_hd64(size: str, out: Path, family_name: str = "qwen3_next") -> None:
    """`hgc init-model` of `size` with attention head_dim 64: FlashInfer 0.6.0 builds no prefill for
    the head dim 32 of qwen3_next's tiny and small configs (routing refuses it: FlashInfer's shape limit), and
    "bench" (head dim 256, 1.7B parameters) is slow to write. Benchmark-side only: the runtime never
    imports models/."""
    from models.checkpoint import write_checkpoint
    from models.families import get_family
    from models.loader import config_dtype

    family = get_family(family_name)
    config = family.make_config(size)
    config["head_dim"] = 64
    text = family.text_config(config)
    model = family.build(text)
    family.init_weights(model, 0)
    model = model.to(config_dtype(text))
    write_checkpoint(out, config, model.checkpoint_tensors(), overwrite=True)


def prompts_for(vocab: int, lens, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def key_names(keys) -> list[str]:
    """The distinct keys of a run's steps, by name ("eager" for steps that ran eagerly)."""
    return sorted({str(k) if k is not None else "eager" for k in keys})


def compare(a: list[list[int]], b: list[list[int]], prompt_lens) -> dict:
    """How greedy tokens b differ from a: count, rate, first differing position per prompt."""
    total = sum(len(x) for x in a)
    diff = sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    first = {}
    for i, (ra, rb) in enumerate(zip(a, b)):
        pos = next((j for j, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
        if pos is not None:
            first[f"prompt{i}(len {prompt_lens[i]})"] = pos
    return {"tokens": total, "mismatched": diff, "mismatch_rate": diff / max(total, 1),
            "first_diff_per_prompt": first, "first_diff": min(first.values()) if first else None}


def logit_drift(eager_logits: list, graph_logits: list, eager: list, graphs: list) -> dict:
    """Whether differing greedy tokens are rounding or a fault: the relative error of the graph
    run's logits against the eager run's, per step while every token still agrees (a fault shows
    at once, rounding starts near bf16's 1e-3 and grows as it feeds back), and the eager top-2
    logit gap of the first differing token (a near-tie flips on rounding)."""
    per_step, gap = [], None
    for i, (e, g) in enumerate(zip(eager_logits, graph_logits)):
        per_step.append(float(f"{rel_err(g, e):.2e}"))
        differ = [b for b in range(len(eager)) if eager[b][i] != graphs[b][i]]
        if differ:
            top2 = e[differ[0]].topk(2).values
            gap = float(f"{(top2[0] - top2[1]).item():.3e}")
            break
    return {"logits_rel_err_per_step": per_step, "eager_top2_gap_at_first_diff": gap}


@contextlib.contextmanager
def decode_batch(runner, state_pool, batch: int, vocab: int, g: torch.Generator, history: int = 64):
    """B requests with a `history`-token past each (prefilled eagerly, 8 at a time), and their next
    decode step's items; slots and pages are freed on exit."""
    seqs = [SeqState(state_pool.alloc()) for _ in range(batch)]
    try:
        for i in range(0, batch, 8):
            items = [(s, torch.randint(1, vocab, (history,), generator=g).tolist()) for s in seqs[i:i + 8]]
            runner.run(build_step(items, runner.kv_pool, "cpu", max_pages=runner.max_pages), None)
            commit_step(items)
        yield [(s, [int(torch.randint(1, vocab, (1,), generator=g))]) for s in seqs]
    finally:
        for s in seqs:
            runner.kv_pool.free(s.pages)
            state_pool.free(s.slot)


def time_ms(fn, device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() between CUDA events (or perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn, device, steps: int = 20, rounds: int = 5) -> float:
    """Milliseconds a call of fn() when `steps` calls are queued one after another without waiting
    between them (the median over `rounds` runs of them): a step as the overlapped engine loop issues
    it, its host staging done while the step before runs on the device. `time_ms` starts every call
    on an idle device, so its figure holds the host's staging and launch before the first kernel
    too. On the CPU, where nothing is queued, the same mean of perf_counter."""
    fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(steps):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def host_speed_ms(reps: int = 21) -> float:
    """Median milliseconds of a fixed pure-Python workload: a lent machine's host speed drifts
    within one call, so a bench records this beside each host-bound timing it compares (two
    timings taken at different host speeds do not compare)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        total = 0
        for i in range(20000):
            total += i & 7
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)


@functools.cache
def _launch_check_graph(device_index: int):
    x = torch.zeros(64, device=torch.device("cuda", device_index))
    x.add_(1)  # the kernel is loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            x.add_(1)
    return graph, x


def launch_check_ms(device: torch.device, iters: int = 50) -> float | None:
    """Median host milliseconds of one replay() of a fixed 100-kernel graph, the device idle before
    each: about 0.004 ms on an H200's host. Taken before a bench's timings and again after its
    profiles; a second value far above the first says the profiler left CUPTI subscribed and the
    timings after it paid for that (see TEARDOWN_CUPTI above). None on the CPU."""
    if device.type != "cuda":
        return None
    graph, _ = _launch_check_graph(device.index if device.index is not None else torch.cuda.current_device())
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(device)
    return round(statistics.median(times), 4)


def profile_call(fn, device, iters: int = 5, top: int | None = 12) -> dict:
    """Where one call's time goes: host time to issue it (perf_counter until fn returns, before
    any wait), device kernel time per call (sum of the profiler's kernel durations; kernels replayed
    from a CUDA graph are traced one by one), and the kernels and host ops that take the most.

    A call whose host time exceeds its kernel time is bound by the host: the device idles between
    launches (`device_gaps` says where). On the CPU only the host side is reported. `top`: how
    many kernels and host ops to list, the most costly first (None: all of them)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
            if cuda:
                torch.cuda.synchronize(device)  # each call starts on an idle device, as time_ms's do
    # One call's kernels in the order they ran (the last call of the profile): where the copies,
    # memsets and small kernels sit between the big ones, and where the device waits between them.
    ordered = device_kernels(prof) if cuda else []
    per = len(ordered) // max(iters, 1)
    one_call = ordered[len(ordered) - per:]
    k_rows = per_call_rows(((e.name, e.device_time_total) for e in ordered), iters)
    h_rows = per_call_rows(((e.name, e.self_cpu_time_total) for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CPU), iters)
    return {"host_issue_ms": statistics.median(host), "kernel_ms": round(sum(r["ms"] for r in k_rows), 4),
            "kernels_per_call": sum(r["calls"] for r in k_rows), "top_kernels": k_rows[:top],
            "top_host_ops": h_rows[:top], "kernel_sequence": [e.name[:60] for e in one_call],
            **device_gaps(one_call)}


def request_timeline(setup, fn, device, iters: int = 5, top: int = 12) -> dict:
    """Where one request's time to its first token goes on the device: `fn` (the request, on an
    idle engine after `setup()`, which is not profiled) under the profiler, `iters` times. Per
    call: the host time from fn's start to its first kernel (what the host does before the device
    has work), the kernels' sum, the span from fn's start to the last kernel's end, the device's
    idle time inside its kernels' span (`device_gaps`), and the costliest kernels. The profiler
    widens host times (see `device_gaps`), so the split says where the time goes, not how long an
    unprofiled request takes. CUDA only (None on the CPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if device.type != "cuda":
        return None
    calls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            setup()
            torch.cuda.synchronize(device)
            with record_function(f"request_{i}"):
                fn()
            torch.cuda.synchronize(device)
    events = prof.events()
    # the marks' own ranges appear on the device's timeline too (user annotations): not kernels
    kernels = [k for k in device_kernels(prof) if not k.name.startswith("request_")]
    for i in range(iters):
        mark = next(e for e in events if e.name == f"request_{i}")
        start, end = mark.time_range.start, mark.time_range.end
        mine = [k for k in kernels if start <= k.time_range.start <= end]
        if not mine:
            continue
        calls.append({"host_before_first_kernel_ms": (mine[0].time_range.start - start) / 1e3,
                      "kernel_ms": sum(k.time_range.end - k.time_range.start for k in mine) / 1e3,
                      "span_ms": (mine[-1].time_range.end - start) / 1e3, "kernels": len(mine),
                      "host_call_ms": (end - start) / 1e3, "mine": mine})
    if not calls:
        return {}
    last = calls[-1]["mine"]
    summary = {k: round(statistics.median(c[k] for c in calls), 4)
               for k in ("host_before_first_kernel_ms", "kernel_ms", "span_ms", "kernels", "host_call_ms")}
    rows = per_call_rows(((k.name, k.time_range.end - k.time_range.start) for c in calls for k in c["mine"]), len(calls))
    return {**summary, "top_kernels": rows[:top], **device_gaps(last, top)}


def device_kernels(prof) -> list:
    """A torch.profiler run's kernel events (graph replays traced one by one), in the order they ran."""
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def per_call_rows(named_us, calls: int) -> list[dict]:
    """(name, microseconds) events summed per name over `calls` calls: {"name", "calls", "ms"} per
    call, the costliest first (names cut at 90 characters)."""
    totals: dict[str, list] = {}
    for name, us in named_us:
        row = totals.setdefault(name[:90], [0, 0.0])
        row[0] += 1
        row[1] += us / 1e3
    return sorted(({"name": n, "calls": c / calls, "ms": round(t / calls, 4)} for n, (c, t) in totals.items()),
                  key=lambda r: -r["ms"])


def device_gaps(kernels: list, top: int = 12) -> dict:
    """Where the device waits inside one call (its kernels' profiler events, in order): the span
    from the first kernel's start to the last one's end, the idle time between kernels in it, and
    the longest idle gaps with the kernels on either side (a gap where the host was behind: an
    eager op's launch path, a piece's replay, a wait on the device). Measured under the profiler,
    which widens them: it traces a graph's kernels one by one and adds host time to each launch
    (cudaGraphLaunch about 0.07 ms under it against 0.006 ms without), so these say where the
    device waits, not for how long it waits in an unprofiled step."""
    if not kernels:
        return {}
    pairs = list(zip(kernels, kernels[1:]))
    gaps = [{"us": round(b.time_range.start - a.time_range.end, 1), "before_kernel": i + 1,
             "after": a.name[:50], "next": b.name[:50]} for i, (a, b) in enumerate(pairs)]
    return {"device_span_ms": round((kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3, 4),
            "device_idle_ms": round(sum(max(g["us"], 0.0) for g in gaps) / 1e3, 4),
            "longest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top]}


def replay_host_split(runner, step, key, iters: int = 50, sync=None) -> dict:
    """Median host milliseconds of a whole-step replay's three parts, the device synchronised
    between calls (`sync`, default torch.cuda.synchronize): the copy into the static buffers
    (`_fill`), the backends' hook (`_plan`) and the graph launch (`replay()`). The device idles for
    all three before the step's first kernel. (Reaches into the runner's parts on purpose:
    `run_outputs` is exactly these three calls.)"""
    sync = sync or torch.cuda.synchronize
    graph, _ = runner._full_graphs[key]  # (graph, its static outputs)
    parts = {"fill_ms": [], "plan_ms": [], "replay_ms": []}
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        _, ctx = runner._fill(step, key)
        t1 = time.perf_counter()
        runner._plan(ctx, key)
        t2 = time.perf_counter()
        with runner.ops.step(ctx):  # as run_outputs replays: a CPU stand-in reruns the ops there
            graph.replay()
        t3 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[name].append(dt * 1e3)
    sync()
    return {name: round(statistics.median(v), 4) for name, v in parts.items()}


def host_profile(fn, iters: int = 20, top: int = 20, sync=None) -> dict:
    """The Python functions that take fn's host time (cProfile over `iters` calls, the device
    synchronised between calls so no call waits on an earlier one): the top functions by own time
    and by cumulative time, milliseconds per call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(iters):
        if sync is not None:
            sync()
        prof.enable()
        fn()
        prof.disable()
    if sync is not None:
        sync()
    rows = [{"function": f"{Path(file).name}:{line}:{name}", "calls_per_call": ncalls / iters,
             "own_ms": round(tottime * 1e3 / iters, 4), "cum_ms": round(cumtime * 1e3 / iters, 4)}
            for (file, line, name), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items()]
    return {"top_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "top_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn captured alone in a CUDA graph, run once outside the capture first (Triton compiles, the
    allocator settles) and replayed once: timing its replays leaves Python launch time out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_call_us(call, calls: int, replays: int, device, rotate: int = 1) -> float:
    """Microseconds of one call(i) inside a CUDA graph of `calls` calls, i cycling over range(rotate)
    (a kernel benchmark's copies of its weights, rotated so the L2 holds none of them; `calls`
    rounded up to a multiple of it): the graph's replays timed by `time_ms`, median over `replays`.
    On the CPU, one eager call's wall time."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        call(0)
        return (time.perf_counter() - t0) * 1e6
    calls = rotate * max(1, -(-calls // rotate))
    graph = capture_graph(lambda: [call(j % rotate) for j in range(calls)])  # run once, captured, replayed once
    us = 1e3 * time_ms(graph.replay, device, replays, warmup=0) / calls
    del graph
    return us


def synchronizer(device: torch.device):
    """A no-argument function that waits for the device's queued work (nothing to wait for on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _whole(art_dir: Path, pieces: bool) -> bool:
    """Whether an earlier run left a whole artifact: its manifest, and with pieces a bundle too. A
    compile cut off while it built the bundle leaves the artifact without one, whose glue runs
    traced: an account of it would time the traced glue as if it were the bundle's."""
    from compiler.splitops.bundle import BUNDLE, TARGETS

    if not (art_dir / "manifest.json").is_file():
        return False
    return not pieces or any((art_dir / TARGETS).glob(f"*/{BUNDLE}"))


def compiled_artifact(args) -> Path:
    """WORK/FAMILY-SIZE-art: `hgc init-model` and `hgc compile` (--target cuda --dtype bfloat16 on
    the GPU, cpu in a dry run) unless an earlier run left it there. With `args.compiled_pieces`
    (--compiled-pieces), WORK/FAMILY-SIZE-art-compiled: the compile also builds the target bundle
    (Inductor-compiled pieces and every kernel, as `hgc compile --target cuda` does by default on a
    GPU machine; --inductor on the CPU), which takes minutes; without it the traced glue runs.
    With `args.artifact` (--artifact), that folder as it is."""
    from hgc import main as hgc

    if getattr(args, "artifact", None):
        return Path(args.artifact)

    work = Path(args.work)
    pieces = bool(getattr(args, "compiled_pieces", False))
    config = getattr(args, "config", None)
    ckpt = work / (f"{args.family}-{args.size}" if not config else f"config-{release_config(config).stem}")
    routes = list(getattr(args, "route", None) or [])
    # Artifacts of other routes sit beside each other in one --work: the folder names a digest of them.
    routed = "-r" + hashlib.sha256("\n".join(routes).encode()).hexdigest()[:8] if routes else ""
    dtype = getattr(args, "dtype", None)
    invariant = bool(getattr(args, "batch_invariant", False))
    art_dir = work / (f"{ckpt.name}-art{'-compiled' if pieces else ''}{routed}{'-' + dtype if dtype else ''}"
                      f"{'-invariant' if invariant else ''}")
    if not _whole(art_dir, pieces):
        if config:  # the folder holds config.json alone: nothing else is read
            ckpt.mkdir(parents=True, exist_ok=True)
            shutil.copy(release_config(config), ckpt / "config.json")
        elif not (ckpt / "config.json").is_file():
            assert hgc(["init-model", "--family", args.family, "--size", args.size, "--seed", "0", "-o", str(ckpt),
                        "--force"]) == 0
        target = ["--target", "cpu"] if args.dry_run else ["--target", "cuda", "--dtype", dtype or "bfloat16"]
        if args.dry_run and dtype:
            target += ["--dtype", dtype]
        inductor = ["--inductor"] if pieces else ["--no-inductor"]
        route_args = [arg for route in routes for arg in ("--route", route)]
        weights = ["--no-weights"] if config else []
        argv = ["compile", str(ckpt), "-o", str(art_dir), "--force", "--no-dumps", *inductor, *target, *route_args,
                *weights, *(["--batch-invariant"] if invariant else [])]
        if pieces:
            # In a process of its own: a build's start-up imports FlashInfer, and this process must
            # load the bundle before anything imports it (runtime/artifact/bundle.py points FlashInfer's
            # module cache at the bundle's copy then, and refuses once it is imported).
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            subprocess.run([sys.executable, "-m", "hgc", *argv], env=env, check=True)
        else:
            assert hgc(argv) == 0
    return art_dir


def bench_engine(art, draft_tokens: int, device, *, drafter_wrap=None, slots: int = 1, max_len: int = 0,
                 graphs=None, eager: bool = False, fixed_draft_products: bool = False):
    """An engine as `hgc serve` builds it (graph runners included; `graphs` None: CudaGraphs; `eager`:
    no graph runner, every step eager, as `--no-graphs`), with `draft_tokens` drafts from the
    artifact's draft program, optionally wrapped (`drafter_wrap(drafter)`: e.g.
    testkit/spec_drafters.ForcedDrafts); `fixed_draft_products`: runtime/assembly.engine_for_artifact's."""
    from runtime.assembly import EngineOptions, engine_for_artifact

    log = lambda line: print(f"  {line}", flush=True)  # noqa: E731
    options = EngineOptions(slots=slots, token_budget=512, speculative_tokens=draft_tokens, prefix_cache=False)
    return engine_for_artifact(art, options, max_len, device=device, graphs=False if eager else graphs or True,
                               log=log, drafter_wrap=drafter_wrap, fixed_draft_products=fixed_draft_products)


def release_config(name: str) -> Path:
    """--config: tests/configs/NAME.json (a published release's config, SOURCES.md there) or a path."""
    path = Path(name) if name.endswith(".json") else ROOT / "tests" / "configs" / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(f.stem for f in (ROOT / "tests" / "configs").glob("*.json")))
        raise SystemExit(f"--config {name}: no such file {path} (published configs: {known})")
    return path


def load_format(args) -> str:
    """How compiled_artifact's artifact loads: random weights for a --config run (it has none)."""
    return "dummy" if getattr(args, "config", None) else "auto"


def verdict(met: bool | None, dry_run: bool, on_cpu: bool = False) -> str:
    """A target's word. A dry run measures a tiny model on the CPU: a goal set for the GPU at bench
    size is not judged there (only a target marked on_cpu, one the CPU itself is asked to meet)."""
    if dry_run and not on_cpu:
        return "not judged (a GPU goal; this is a dry run)"
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def target_rows(rec: dict) -> list[str]:
    """One line per checked target of rec["targets"] ({name: {value, goal, met[, on_cpu]}})."""
    dry = bool(rec.get("config", {}).get("dry_run"))
    return [f"{name}: {t['value']:.3g} (goal {t['goal']}): {verdict(t['met'], dry, t.get('on_cpu', False))}"
            for name, t in rec.get("targets", {}).items()]


def engine_script(argv, doc: str, name: str, defaults: dict, add_arguments, bench, table, label) -> dict:
    """Parse the shared flags (--out, --work, --dry-run, --family, --size, --iters, --skip) and the
    script's own (`add_arguments(parser)`), fill what is unset from defaults["gpu"] or
    defaults["dry"], run `bench(args, rec, save)` guarded, write OUT/NAME.json (after every stage
    through `save`, and at the end) and print `table(rec)`. label(args): the run's title line."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"folder for {name}.json")
    p.add_argument("--work", default=None, help="folder for the checkpoint and artifact (default: OUT/work)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny size, reference backend: the script's own test")
    p.add_argument("--family", default=None)
    p.add_argument("--size", default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--skip", default="", help="stages to skip, comma-separated")
    p.add_argument("--artifact", default=None,
                   help="an artifact compiled already (e.g. the one hgc serve runs) instead of compiling --family --size")
    p.add_argument("--compiled-pieces", action="store_true",
                   help="run the artifact with its target bundle (Inductor-compiled pieces, every kernel built ahead): "
                        "the compile builds it first, minutes on the GPU; default: the traced glue")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="hgc compile --dtype (default: bfloat16 on the GPU, the checkpoint's float32 in a dry run); "
                        "float32 on the GPU tells rounding from a fault where bf16 results differ")
    p.add_argument("--config", default=None,
                   help="a published release's config.json at full size, with random weights (the name of one in "
                        "tests/configs, e.g. qwen3_6_27b, or a path): compiled with --no-weights, loaded with "
                        "--load-format dummy; --family follows its model_type, --size is not used")
    p.add_argument("--route", action="append", default=[],
                   help="passed to hgc compile --route (repeatable), e.g. "
                        "'gdn_core=triton_linear[short_extend_tokens=64]'; the artifact's folder names the routes")
    p.add_argument("--batch-invariant", action="store_true",
                   help="hgc compile --batch-invariant (GPU only): decode and verify rows computed alike whatever "
                        "shares their step; the artifact's folder says so")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.batch_invariant and args.dry_run:
        p.error("--batch-invariant: its kernels are built for CUDA; not with --dry-run")
    if args.config:
        from models.families import family_for_config

        path = release_config(args.config)
        args.family, args.size = family_for_config(json.loads(path.read_text()), str(path)).name, "release"
    for key, value in defaults["dry" if args.dry_run else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or str(out / "work")
    rec = {"env": device_facts(args.dry_run), "config": dict(vars(args)), "stages": {}}
    path = out / f"{name}.json"

    def save():
        path.write_text(json.dumps(rec, indent=1, default=str))

    run_guarded(label(args), rec, lambda: bench(args, rec, save))
    save()
    print(table(rec))
    return rec
