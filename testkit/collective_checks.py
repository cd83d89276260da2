"""Checks of the symmetric-memory all-reduce against NCCL's, one process per GPU.

Used by tests/gpu/test_gpu_collectives.py (the check alone) and benchmarks/kernels/allreduce_bench.py (the
check, then the timings). `run_ranks(fn, world)` starts one process per GPU with an NCCL group
and returns what each rank's `fn(rank, world, device)` returned; `check_against_nccl` is one
rank's check.

What is checked, on fresh random tensors, against `dist.all_reduce` of the same tensor:
- eager calls of `SymmMemAllReduce.all_reduce` in bf16 and float32 at sizes from one element to
  its buffer's size and past it (NCCL's part), on aligned tensors (the one-kernel path) and on
  a view two bytes off (the staged path);
- the same calls captured in one CUDA graph on static tensors, replayed three times with new
  values written in between: a captured one-shot call sums what the tensor holds at replay.
With two ranks every element is one addition of two numbers, rounded once whoever adds them,
so the sums must be equal bit for bit; with more ranks the order of additions may differ.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch

__all__ = ["run_ranks", "check_against_nccl", "SIZES"]

HANG_S = 90  # a rank that has not finished by then is stuck (the whole check takes seconds)
SIZES = (1, 7, 8, 1000, 2048, 8 * 2048, 128 * 2048, 256 * 2048, 300 * 2048)  # elements


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, queue) -> None:
    import faulthandler

    import torch.distributed as dist

    # A rank stuck in a collective prints where, then ends, well before the parent stops waiting.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(seconds=120))
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm)  # the communicator exists before anything is captured
        queue.put((rank, "ok", fn(rank, world, device)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))
    # The queue's feeder thread must hand the result to the pipe before the process ends.
    queue.close()
    queue.join_thread()
    # Not destroy_process_group: after collectives captured in graphs it can block forever
    # (runtime/dist/distributed.py says why); the process ends here instead.
    os._exit(0)


def run_ranks(fn, world: int = 2, timeout_s: float = HANG_S + 30) -> list:
    """fn(rank, world, device) on one process per GPU; its return values, by rank. A rank's error raises."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _compare(got: torch.Tensor, ref: torch.Tensor, world: int) -> dict:
    diff = (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0
    rel = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item() if got.numel() else 0.0
    ok = torch.equal(got, ref) if world == 2 else rel < 1e-2
    return {"max_abs_diff": diff, "rel_err": rel, "ok": bool(ok)}


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator(device=t.device).manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))


def check_against_nccl(rank: int, world: int, device: torch.device) -> list[dict]:
    """One rank's rows: (size, dtype, path, eager or graph) and whether it matched NCCL."""
    import sys

    import torch.distributed as dist

    from runtime.backends.collectives import SymmMemAllReduce
    from runtime.backends.protocol import BackendSetup

    backend = SymmMemAllReduce.build(BackendSetup(None, None, device, (), {}))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        limit = backend.buffer.numel() // torch.tensor([], dtype=dtype).element_size()
        for n in SIZES + (limit, limit + 8):
            for offset in (0, 1):  # 1: a view 2 or 4 bytes into its storage, the staged path
                base = torch.empty(n + offset, device=device, dtype=dtype)
                x = base[offset:]
                _fill(x, seed=1000 * rank + n + offset)
                ref = x.clone()
                dist.all_reduce(ref)
                print(f"rank {rank}: {dtype} {n} elements at offset {offset}", file=sys.stderr, flush=True)
                path = backend.path(x)
                backend.all_reduce(None, x, 0)
                rows.append({"numel": n, "dtype": str(dtype), "path": path, "how": "eager", **_compare(x, ref, world)})
    # Captured: three calls of different paths in one graph, replayed with new values.
    n_small, n_big = 8 * 2048, (backend.buffer.numel() // 2) + 4096
    statics = [torch.empty(n_small, device=device, dtype=torch.bfloat16),
               torch.empty(n_small + 1, device=device, dtype=torch.bfloat16)[1:],
               torch.empty(n_big, device=device, dtype=torch.bfloat16)]
    for i, t in enumerate(statics):
        _fill(t, seed=7 + i + 100 * rank)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the capture, as the graph runner does
        for t in statics:
            backend.all_reduce(None, t, 0)
    torch.cuda.current_stream(device).wait_stream(stream)
    print(f"rank {rank}: eager checks done, capturing", file=sys.stderr, flush=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in statics:
            backend.all_reduce(None, t, 0)
    for replay in range(3):
        refs = []
        for i, t in enumerate(statics):
            _fill(t, seed=10_000 * (replay + 1) + 100 * rank + i)
            ref = t.clone()
            dist.all_reduce(ref)
            refs.append(ref)
        graph.replay()
        torch.cuda.synchronize(device)
        for t, ref in zip(statics, refs):
            rows.append({"numel": t.numel(), "dtype": str(t.dtype), "path": backend.path(t),
                         "how": f"graph replay {replay}",
                         **_compare(t, ref, world)})
    return rows
