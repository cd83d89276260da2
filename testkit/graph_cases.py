"""Graph runner test helpers: a CPU stand-in for CUDA graphs, and greedy decoding through a runner.

`RerunGraphs` stands in for runtime.graphs.runner.CudaGraphs on the CPU, so the graph runner's
bookkeeping runs in CI.

`RerunGraphs().capture(fn, pool)` runs fn once and returns its output tensors, as a CUDA graph
capture hands back tensors in the graph's pool. `replay()` runs fn again and copies the result
into those same tensors, so a replay writes where the capture's outputs live and every later
reader sees the new values, as with a real graph. What it cannot show: a CUDA graph freezes the
host-side values and launch arguments of its kernels at capture, while a rerun reads them afresh,
so capture-safety of a kernel is checked only on the GPU (tests/gpu/test_gpu_graphs.py).

`inside` tells a test backend whether it runs in a capture or replay, so it can misbehave only
there: the start-up parity check must catch it.

`RecordingSideStream` stands in for runtime.graphs.side_stream.CudaSideStream on the CPU: the loader then
rewrites pieces with side branches as it does on a GPU, and the stand-in records each fork,
leave and join (and refuses them out of order), so the rewritten pieces run, in graph order, in CI.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from runtime.cache.batch import SeqState, build_step, commit_step


class _Rerun:
    def __init__(self, owner: "RerunGraphs", fn, out):
        self.owner, self.fn, self.out = owner, fn, out

    def replay(self) -> None:
        for dst, src in zip(tree_leaves(self.out), tree_leaves(self.owner.in_graph(self.fn))):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class RerunGraphs:
    replays_call_ops = True  # the runner then observes op outputs during a replay

    def __init__(self):
        self.inside = False  # True while a capture or a replay runs: an op can tell where it runs

    def check_device(self, device) -> None:
        pass

    def new_pool(self):
        return None

    def in_graph(self, fn):
        """Run fn as the body of a capture or a replay. Inside another, it is refused, as CUDA refuses
        a capture or replay while a capture runs on the stream."""
        if self.inside:
            raise RuntimeError("a graph capture or replay inside another capture (CUDA refuses it)")
        self.inside = True
        try:
            return fn()
        finally:
            self.inside = False

    def capture(self, fn, pool):
        out = self.in_graph(fn)
        return _Rerun(self, fn, out), out

    def synchronize(self, device) -> None:
        pass


class RecordingSideStream:
    """fork / leave / join as a rewritten piece calls them, recorded; a call out of order is an error."""

    def __init__(self):
        self.calls: list[str] = []
        self.kept: list[int] = []  # how many main-stream values each join kept alive
        self.on_side = False
        self.open = 0

    def fork(self) -> None:
        assert not self.on_side and self.open == 0, "fork inside an open branch"
        self.calls.append("fork")
        self.on_side, self.open = True, 1

    def leave(self) -> None:
        assert self.on_side, "leave without a fork"
        self.calls.append("leave")
        self.on_side = False

    def join(self, *keep) -> None:
        assert not self.on_side and self.open == 1, "join before the side branch was left"
        self.calls.append("join")
        self.kept.append(sum(isinstance(k, torch.Tensor) for k in keep))
        self.open = 0


def greedy(runner, state_pool, prompts, n: int, *, eager: bool = False, sync=None, logits=None):
    """n greedy tokens per prompt through runner.build/run (graphs once captured), or every step
    eager (`eager`): (tokens per prompt, the key of each step, None where it ran eagerly). `sync()`
    (if given) waits for the device at the end. Slots and pages are freed at the end. A list
    given as `logits` gets each step's logits [B, V], float32 on the CPU.

    A runner is anything with build(items) -> (step, key), run(step, key) -> logits, kv_pool and
    max_pages: a GraphRunner, or a benchmark's eager model."""
    seqs = [SeqState(state_pool.alloc()) for _ in prompts]
    pending, outs, keys = [list(p) for p in prompts], [[] for _ in prompts], []
    try:
        with torch.no_grad():
            for _ in range(n):
                items = list(zip(seqs, pending))
                if eager:
                    step, key = build_step(items, runner.kv_pool, "cpu", max_pages=runner.max_pages), None
                else:
                    step, key = runner.build(items)
                out = runner.run(step, key)
                if logits is not None:
                    logits.append(out.to("cpu", torch.float32, copy=True))  # a graph's output is overwritten next step
                nxt = out.argmax(-1).tolist()  # read before the next replay overwrites them
                keys.append(key)
                commit_step(items)
                for o, t in zip(outs, nxt):
                    o.append(t)
                pending = [[t] for t in nxt]
        if sync is not None:
            sync()
    finally:
        for s in seqs:
            runner.kv_pool.free(s.pages)
            state_pool.free(s.slot)
    return outs, keys


def write_tiny_qwen3_next_hd64(folder) -> None:
    """A tiny qwen3_next checkpoint with head_dim 64 in `folder` (FlashInfer builds no prefill for
    tiny's head dim 32), weights seeded 1: what the GPU graph tests compile for the cuda target."""
    from models.checkpoint import write_checkpoint
    from models.families import get_family
    from models.loader import config_dtype

    family = get_family("qwen3_next")
    config = family.make_config("tiny")
    config["head_dim"] = 64
    text = family.text_config(config)
    model = family.build(text)
    family.init_weights(model, 1)
    write_checkpoint(folder, config, model.to(config_dtype(text)).checkpoint_tensors())
