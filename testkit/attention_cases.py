"""FlashInfer and Triton attention backends against the CPU reference, on a CUDA GPU: the checks
shared by tests/gpu/test_gpu_attention.py (which asserts them) and benchmarks/kernels/gpu_attention.py
(which prints them as a table).

Every check drives two pools with the same page assignment: a CPU pool under
CPUReferenceBackend (the oracle, float32 math) and a GPU pool under FlashInferAttentionBackend.
Inputs are fresh random bf16 per step, output rows are poisoned with NaN before each run, and a
check passes when ||out - ref|| / ||ref|| <= 1e-2 over the real rows, every real row is finite,
padded rows are zero, and the GPU pool holds exactly the CPU pool's bytes afterwards (so the
K/V store wrote every real row and no padding row). The `check_*` functions return a result dict
instead of asserting.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.cache.kv_pool import KVPool

TOL = 1e-2
FP32_TOL = 1e-4  # float32 inputs: `ieee` dots in the Triton kernels, float32 softmax on both sides
MLA_R, MLA_P = 512, 64
MLA_SCALE = (128 + 64) ** -0.5  # Kimi-Linear / DeepSeek: qk_nope 128 + rope 64 before absorption


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    name: str
    kind: str  # "gqa" or "mla"
    heads: int
    kv_heads: int = 1
    head_dim: int = MLA_R

    @property
    def scale(self) -> float:
        return MLA_SCALE if self.kind == "mla" else self.head_dim ** -0.5

    def kv_spec(self, dtype: str = "bfloat16") -> dict[str, TensorSpec]:
        if self.kind == "mla":
            return {"latent": TensorSpec((MLA_R + MLA_P,), dtype)}
        shape = (self.kv_heads, self.head_dim)
        return {"k": TensorSpec(shape, dtype), "v": TensorSpec(shape, dtype)}

    def kv_bytes_per_token(self) -> int:
        return sum(s.nbytes for s in self.kv_spec().values())


QWEN3_NEXT = AttnConfig("gqa16/2/256", "gqa", 16, 2, 256)
MHA_128 = AttnConfig("gqa8/8/128", "gqa", 8, 8, 128)
GQA_64 = AttnConfig("gqa16/2/64", "gqa", 16, 2, 64)  # the bench's heads at FlashInfer's smallest head dim
MLA_16 = AttnConfig("mla16/512+64", "mla", 16)
MLA_32 = AttnConfig("mla32/512+64", "mla", 32)


class Harness:
    """A CPU reference pool and a GPU pool with the same pages; `step` runs one step on both.

    dtype: of the inputs and caches (bf16; float32 only for kernels that take it: the Triton
    decode and MLA kernels, which must then agree with the reference to FP32_TOL)."""

    def __init__(self, cfg: AttnConfig, num_pages: int, page_size: int = 16, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, **backend_kwargs):
        from runtime.backends.flashinfer_attention import FlashInferAttentionBackend

        self.cfg, self.dtype = cfg, dtype
        self.tol = FP32_TOL if dtype == torch.float32 else TOL
        kind = LayerKind.FULL_MLA if cfg.kind == "mla" else LayerKind.FULL_GQA
        registry = LayerRegistry([LayerSpec(0, kind, kv=cfg.kv_spec(str(dtype).removeprefix("torch.")))])
        self.cpu_pool = KVPool(registry, num_pages, page_size)
        self.gpu_pool = KVPool(registry, num_pages, page_size, device="cuda")
        self.ref = CPUReferenceBackend(self.cpu_pool, None)
        # FlashInfer's decode unless a test names the Triton one (the backend's default) itself
        backend_kwargs.setdefault("decode_impl", "flashinfer")
        self.backend = FlashInferAttentionBackend(self.gpu_pool, q_heads=cfg.heads, scales=cfg.scale, **backend_kwargs)
        self.gen = torch.Generator().manual_seed(seed)
        self.graph = None  # (CUDAGraph, static inputs, static out) once captured

    # -- inputs --------------------------------------------------------------------------------

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def inputs(self, T: int) -> dict[str, torch.Tensor]:
        c = self.cfg
        if c.kind == "mla":
            return {"q_latent": self.randn(T, c.heads, MLA_R), "q_rope": self.randn(T, c.heads, MLA_P),
                    "kv_latent": self.randn(T, MLA_R), "k_rope": self.randn(T, MLA_P)}
        return {"q": self.randn(T, c.heads, c.head_dim), "k": self.randn(T, c.kv_heads, c.head_dim),
                "v": self.randn(T, c.kv_heads, c.head_dim)}

    def out_shape(self, T: int) -> tuple[int, ...]:
        return (T, self.cfg.heads, MLA_R if self.cfg.kind == "mla" else self.cfg.head_dim)

    def call(self, backend, ctx, x: dict, out: torch.Tensor) -> None:
        if self.cfg.kind == "mla":
            backend.mla_attention(ctx, x["q_latent"], x["q_rope"], x["kv_latent"], x["k_rope"], out, 0, self.cfg.scale)
        else:
            backend.gqa_attention(ctx, x["q"], x["k"], x["v"], out, 0, self.cfg.scale)

    # -- caches --------------------------------------------------------------------------------

    def new_seqs(self, cached: list[int]) -> list[SeqState]:
        """Requests whose first `cached[i]` tokens are already in both pools (random values).

        Pages are handed out one at a time round-robin, so a request's pages are not contiguous.
        """
        ps = self.cpu_pool.page_size
        seqs = [SeqState(slot=i + 1) for i in range(len(cached))]
        need = [self.cpu_pool.pages_for(n) for n in cached]
        while any(len(s.pages) < n for s, n in zip(seqs, need)):
            for s, n in zip(seqs, need):
                if len(s.pages) < n:
                    s.pages.extend(self.cpu_pool.alloc(1))
        for s, n in zip(seqs, cached):
            if n == 0:
                continue
            pos = torch.arange(n)
            slots = torch.tensor(s.pages)[pos // ps] * ps + pos % ps
            for name, buf in self.cpu_pool.layer(0).items():
                buf.view(-1, *buf.shape[2:])[slots] = self.randn(n, *buf.shape[2:])
            s.num_cached = n
        for name, buf in self.cpu_pool.layer(0).items():
            self.gpu_pool.layer(0)[name].copy_(buf)
        return seqs

    def caches_match(self) -> bool:
        return all(torch.equal(self.gpu_pool.layer(0)[name].cpu(), buf) for name, buf in self.cpu_pool.layer(0).items())

    # -- one step ------------------------------------------------------------------------------

    def step(self, items: list[tuple[SeqState, int]], pad_tokens_to: int | None = None, pad_seqs_to: int | None = None,
             graph: str | None = None, max_pages: int | None = None, mode: Mode | None = None) -> dict:
        """Run one step on both backends. graph: None (eager), "capture" or "replay"; mode: the
        step's mode (default: what its lengths make it; Mode.TARGET_VERIFY must be asked for)."""
        step_items = [(s, [0] * n) for s, n in items]
        built = build_step(step_items, self.cpu_pool, pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to,
                           max_pages=max_pages, mode=mode)
        ctx = built.ctx
        T = ctx.num_tokens
        x = self.inputs(T)
        n_real = ctx.num_real_tokens
        if n_real < T:  # garbage in padding rows must reach no real row and no cache page
            for t in x.values():
                t[n_real:] = float("nan")
        ref_out = torch.empty(self.out_shape(T), dtype=torch.float32)
        self.call(self.ref, ctx, x, ref_out)

        gctx = dataclasses.replace(ctx, **{f: getattr(ctx, f).cuda() for f in
                                           ("query_start_loc", "seq_lens", "state_slots", "page_table", "slot_mapping")})
        gx = {k: v.cuda() for k, v in x.items()}
        if graph is None:
            out = torch.full(self.out_shape(T), float("nan"), dtype=self.dtype, device="cuda")
            self.backend.init_step_metadata(gctx)
            self.call(self.backend, gctx, gx, out)
        elif graph == "capture":
            out = self._capture(gctx, gx)
        else:
            out = self._replay(gctx, gx)
        torch.cuda.synchronize()
        commit_step(step_items)
        out = out.float().cpu()
        real, pad = out[:n_real], out[n_real:]
        ref = ref_out[:n_real]
        err = float((real - ref).norm() / ref.norm().clamp_min(1e-30))
        finite = bool(torch.isfinite(real).all())
        pad_zero = bool((pad == 0).all())
        return {"err": err if finite else float("nan"), "finite": finite, "pad_zero": pad_zero,
                "rows": n_real, "ok": finite and pad_zero and err <= self.tol, "out": real}

    def _capture(self, gctx, gx) -> torch.Tensor:
        """What a graph runner does for a new bucket: allocate, plan, warm up, capture, replay."""
        be, bucket = self.backend, gctx.num_seqs
        be.init_capture_state(gctx.num_tokens, bucket)  # a target_verify bucket has n rows per request
        be.init_replay_state(gctx, bucket)
        out = torch.full(self.out_shape(gctx.num_tokens), float("nan"), dtype=self.dtype, device="cuda")
        self.call(be, gctx, gx, out)  # warm-up outside the capture: compiles the Triton kernels
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.call(be, gctx, gx, out)
        g.replay()
        self.graph = (g, gx, out)
        return out

    def _replay(self, gctx, gx) -> torch.Tensor:
        """A replay with another step's context object: the graph must read only the backend's
        static buffers (refilled by init_replay_state) and the runner's static inputs."""
        g, sx, out = self.graph
        for k in sx:
            sx[k].copy_(gx[k])
        out.fill_(float("nan"))
        self.backend.init_replay_state(gctx, gctx.num_seqs)
        g.replay()
        return out


def _merge(name: str, results: list[dict], extra: dict | None = None) -> dict:
    errs = [r["err"] for r in results]
    return {"name": name, "ok": all(r["ok"] for r in results), "max_err": max(errs) if errs else float("nan"),
            "steps": len(results), "pad_zero": all(r["pad_zero"] for r in results),
            "finite": all(r["finite"] for r in results), **(extra or {})}


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


# -- checks -------------------------------------------------------------------------------------


def check_decode(cfg: AttnConfig, batch: int, max_len: int = 700, page_size: int = 16, seed: int = 0,
                 **kw) -> dict:
    """One decode step of `batch` requests with random cache lengths, then a second one."""
    rng = random.Random(seed)
    cached = _lengths(rng, batch, 1, max_len)
    h = Harness(cfg, num_pages=sum(-(-(n + 2) // page_size) for n in cached) + 4, page_size=page_size, seed=seed, **kw)
    seqs = h.new_seqs(cached)
    results = [h.step([(s, 1) for s in seqs]), h.step([(s, 1) for s in seqs])]
    return _merge(f"decode {cfg.name} b={batch} ps={page_size} {kw or ''}".strip(), results,
                  {"caches_match": h.caches_match()})


def check_extend(cfg: AttnConfig, seed: int = 0, **kw) -> dict:
    """Extend from empty, then a chunked-prefill step over the existing caches, then a mixed step
    (decode + extend + a new request), then a padded step."""
    rng = random.Random(seed)
    h = Harness(cfg, num_pages=256, page_size=16, seed=seed, **kw)
    seqs = h.new_seqs([0, 0, 0])
    results = [h.step([(seqs[0], 37), (seqs[1], 300), (seqs[2], 1)])]
    results.append(h.step([(seqs[0], 50), (seqs[1], 64), (seqs[2], 17)]))
    new = h.new_seqs([0])[0]
    results.append(h.step([(seqs[0], 1), (seqs[1], rng.randint(20, 90)), (seqs[2], 1), (new, 33)]))
    results.append(h.step([(seqs[0], 5), (seqs[1], 1), (new, 9)], pad_tokens_to=32, pad_seqs_to=5))
    return _merge(f"extend+chunked+mixed+pad {cfg.name} {kw or ''}".strip(), results, {"caches_match": h.caches_match()})


def check_padded_decode(cfg: AttnConfig, seed: int = 0, **kw) -> dict:
    """Eager decode with padding rows and padding requests (slot -1, NaN inputs)."""
    h = Harness(cfg, num_pages=64, page_size=16, seed=seed, **kw)
    seqs = h.new_seqs([5, 130, 64])
    results = [h.step([(s, 1) for s in seqs], pad_tokens_to=8, pad_seqs_to=8)]
    return _merge(f"decode padded {cfg.name} {kw or ''}".strip(), results, {"caches_match": h.caches_match()})


def check_graph_decode(cfg: AttnConfig, bucket: int = 8, seed: int = 0, **kw) -> dict:
    """Capture a decode bucket with 5 real requests, replay it with 7 and other lengths, then 3."""
    rng = random.Random(seed)
    h = Harness(cfg, num_pages=2048, page_size=16, seed=seed, **kw)
    seqs = h.new_seqs(_lengths(rng, 7, 1, 900))
    width = 2048 // 7
    results = [h.step([(s, 1) for s in seqs[:5]], pad_tokens_to=bucket, pad_seqs_to=bucket, graph="capture", max_pages=width)]
    results.append(h.step([(s, 1) for s in seqs], pad_tokens_to=bucket, pad_seqs_to=bucket, graph="replay", max_pages=width))
    results.append(h.step([(s, 1) for s in seqs[2:5]], pad_tokens_to=bucket, pad_seqs_to=bucket, graph="replay", max_pages=width))
    return _merge(f"graph decode {cfg.name} bucket={bucket} {kw or ''}".strip(), results, {"caches_match": h.caches_match()})


def check_verify(cfg: AttnConfig, bucket: int = 4, n: int = 4, seed: int = 0, **kw) -> dict:
    """target_verify steps as speculative decoding runs them: every request feeds n tokens (its last
    one and n - 1 drafts) over its cache, causal among them. Eager, then a bucket captured with one
    request fewer than it holds and replayed with a full bucket and with one request. After each
    step a request keeps only some of its n tokens (as after rejected drafts), so the next step
    writes over positions the last one wrote and must not read what it wrote there; cache lengths
    start anywhere and cross page boundaries. Each step against the reference (which attends over
    exactly the cached positions), the caches byte for byte."""
    rng = random.Random(seed)
    h = Harness(cfg, num_pages=1024, page_size=16, seed=seed, **kw)
    seqs = h.new_seqs(_lengths(rng, bucket, 1, 400))
    width = 1024 // bucket
    pad = {"pad_tokens_to": bucket * n, "pad_seqs_to": bucket, "max_pages": width, "mode": Mode.TARGET_VERIFY}
    results = []
    for batch, graph in ((seqs[:bucket - 1], None), (seqs[:bucket - 1], "capture"), (seqs, "replay"),
                         (seqs[1:2], "replay")):
        if graph is None:
            results.append(h.step([(s, n) for s in batch], mode=Mode.TARGET_VERIFY))
        else:
            results.append(h.step([(s, n) for s in batch], graph=graph, **pad))
        for s in batch:  # keep 1 .. n of the n tokens just cached
            s.num_cached -= n - rng.randint(1, n)
    return _merge(f"verify {cfg.name} bucket={bucket} n={n} {kw or ''}".strip(), results,
                  {"caches_match": h.caches_match()})


def check_graph_growing(cfg: AttnConfig, bucket: int = 4, steps: int = 40, seed: int = 0, **kw) -> dict:
    """A decode bucket captured once and replayed step after step while its requests grow (across
    page boundaries, from 1 to 250 cached tokens), against the same steps run eagerly by a second
    backend over the same inputs and caches: each replay equals the eager step (the same kernel;
    the splits follow the request count, 3 eager and 4 in the bucket, which on a 132-SM card is
    32 splits both: the relative difference is 0 there, and within one bf16 rounding, 4e-3,
    anywhere) and both match the reference."""
    rng = random.Random(seed)
    cached = [1, 15, 250, 16, 100, 31, 64][: bucket - 1]
    graph, eager = (Harness(cfg, num_pages=512, page_size=16, seed=seed, **kw) for _ in range(2))
    seqs = {h: h.new_seqs(cached) for h in (graph, eager)}
    width = 256 // bucket
    results, diffs = [], []
    for i in range(steps):
        live = [rng.random() < 0.9 for _ in cached]  # now and then a request sits a step out
        live[0] = True
        pad = {"pad_tokens_to": bucket, "pad_seqs_to": bucket, "max_pages": width}
        g = graph.step([(s, 1) for s, on in zip(seqs[graph], live) if on], graph="capture" if i == 0 else "replay", **pad)
        e = eager.step([(s, 1) for s, on in zip(seqs[eager], live) if on], **pad)  # padded too: the same draws
        diffs.append(float((g["out"] - e["out"]).norm() / e["out"].norm().clamp_min(1e-30)))
        results += [g, e]
    return _merge(f"graph decode growing {cfg.name} bucket={bucket} {kw or ''}".strip(), results,
                  {"caches_match": graph.caches_match() and eager.caches_match(), "max_graph_vs_eager": max(diffs),
                   "ok_graph_vs_eager": max(diffs) <= 4e-3})


# -- pytest ------------------------------------------------------------------------------------
