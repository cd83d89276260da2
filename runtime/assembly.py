"""Engine assembly: one model behind an Engine, with its limits and its tokenizer.

1. `EngineOptions` holds the serving knobs (`hgc serve` flags): slots, running cap, token budget per
   step, page size, KV pages or a memory budget, the longest request, the prefix cache, drafts.
2. `engine_for_artifact(art, options, ...)` builds a loaded artifact's engine in one straight
   function, each stage a named call: the device check; the pools (`_pools`: the memory planner
   when a budget is given, else explicit slots and pages; with speculative decoding, the
   intermediate states and D more positions per request); the backends routing.json names and the
   op tables of both programs (`_bound_ops`); the main step runner (`_graph_runner`, captured and
   parity-checked, or an EagerRunner); the drafter (`_speculative_decoder`, the artifact's draft
   program, with `_draft_runner` beside a graph runner); the compiled pieces' check without a graph
   runner (`compiled_start_up_parity`); the prefix cache; on rank 0 of a tensor-parallel run, the
   step sender (runtime/dist/distributed.lead), and the overlapped schedule turned off (said in the
   log: the other ranks replay each step with its ids on the host); the Engine, everything handed
   to its constructor.
3. `build_engine(registry, bind, options, backend_factory=...)` does the same for an eager model
   (tests): pools, its backend, an EagerRunner over `bind(ops)`, the prefix cache.
4. `load_served_model(artifact)` loads a compiled artifact (runtime/artifact/loader.py), builds its
   engine, finds the tokenizer in the artifact folder (or `tokenizer_dir`), and returns a `ServedModel`.
   It starts with `check_served_inputs`: what the flags and the artifact's own documents decide
   (no such artifact, no tokenizer.json in `tokenizer_dir`, a longest request past the model's
   positions), refused before any weight or program loads; a split `hgc serve` runs it before it
   starts its engine core too.

The backends of an artifact are the ones its routing.json names, built over the pools and bound
node by node (runtime/artifact/binding.py); nothing here picks a backend by device. The device must be the
one the artifact was compiled for (its routing target). On "cuda", unless `graphs=False`, a
GraphRunner captures the artifact's buckets and checks them against eager before the engine takes
a request. An artifact whose compiled pieces were loaded (runtime/artifact/bundle.py) starts inside the
bundle's KernelWatch (a kernel built or tuned at start-up is an error naming it), and without a
GraphRunner its pieces are checked against the traced glue here (runtime/graphs/compiled_parity.py);
on CUDA the engine then watches for kernels built while serving (its `kernel_watch`).

It does not run anything: the EngineLoop (runtime/engine/loop.py) steps the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from compiler.splitops import LayerRegistry
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import Engine
from runtime.engine.speculative import MAX_DRAFT_TOKENS, MTPDrafter, SpeculativeDecoder, check_drafter
from runtime.cache.kv_pool import KVPool, pages_for
from runtime.cache.memory_planner import (build_pools, build_snapshot_pool, check_fits, describe_bytes, plan_memory,
                                    pool_bytes)
from runtime.cache.prefix_cache import DEFAULT_SNAPSHOT_INTERVAL, PrefixCache, PrefixCacheConfig
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool
from runtime.artifact.binding import members_of
from runtime.artifact.tokenizer import TextTokenizer
from runtime.backends import batch_invariant_aten
from runtime.dist.distributed import lead
from runtime.graphs.buckets import buckets_for, extend_seqs
from runtime.graphs.compiled_parity import check_compiled_start_up
from runtime.graphs.startup_parity import check_parity
from runtime.graphs.cuda_graphs import CudaGraphs
from runtime.graphs.runner import GraphRunner
from runtime.graphs.staging import hidden_input_spec
from runtime.graphs.step_runner import EagerRunner

__all__ = ["EngineOptions", "ServedModel", "build_engine", "check_served_inputs", "engine_for_artifact",
           "compiled_start_up_parity", "load_served_model", "DEFAULT_MAX_MODEL_LEN"]

DEFAULT_MAX_MODEL_LEN = 4096  # when neither the flag nor the model says less


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    slots: int = 64  # state slots: the most requests that hold state at once
    max_running: int | None = None  # requests in one step (None: every slot)
    token_budget: int = 512  # tokens per step (prefill chunks and decodes together)
    page_size: int = 16
    kv_pages: int | None = None  # None: enough for every slot at max_model_len (or the planner's share)
    memory_budget_bytes: int | None = None  # weights + state + KV; the planner splits it
    max_model_len: int | None = None  # prompt + output tokens of one request
    prefix_cache: bool = True  # reuse cached prefixes (KV pages and linear-state snapshots)
    prefix_snapshots: int | None = None  # snapshot pool size without a budget (None: one per slot)
    snapshot_share: float = 0.1  # with a budget: the planner's share for the snapshot pool
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL  # tokens between chunk-end snapshots of a request
    speculative_tokens: int = 0  # D draft tokens verified per decoding request and step (0: no speculation)
    # Lay out and launch a step while the one before runs (Engine's overlapped schedule); its greedy
    # tokens are checked against synchronous steps on the CPU for every family
    # (tests/runtime/engine/test_overlap.py) and through CUDA graphs (tests/gpu/test_gpu_overlapped_engine.py).
    overlap: bool = True
    # A step with prompt chunks and at least this many decodes runs them as two forwards (Engine,
    # "Decodes apart"; docs/DESIGN.md has the measured costs); 0: never. On one H200 a decode row
    # costs about 0.14 ms in a mixed step and a decode step 1.05 ms at 1 request: the two break
    # even near 9 decodes, and 16 leaves a margin.
    decodes_apart_from: int = 16

    def __post_init__(self):
        for name in ("slots", "token_budget", "page_size", "snapshot_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        for name in ("max_running", "kv_pages", "memory_budget_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        if self.prefix_snapshots is not None and self.prefix_snapshots < 0:
            raise ValueError(f"--prefix-snapshots must be at least 0 (got {self.prefix_snapshots})")
        if self.prefix_snapshots is not None and self.memory_budget_bytes is not None:
            raise ValueError("--prefix-snapshots: with a memory budget the planner sizes the snapshot pool; "
                             "set its share with --snapshot-share")
        if not 0 <= self.snapshot_share < 1:
            raise ValueError(f"--snapshot-share must be in [0, 1) (got {self.snapshot_share})")
        if not 0 <= self.speculative_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-tokens must be in 0..{MAX_DRAFT_TOKENS} (got {self.speculative_tokens})")


@dataclasses.dataclass
class ServedModel:
    name: str  # what clients send as "model"
    engine: Engine | None  # None in the API server of a split `hgc serve`: the engine is the core process's
    vocab_size: int
    max_model_len: int  # prompt + max_tokens of one request, at most
    tokenizer: TextTokenizer | None = None
    eos_token_id: int | None = None  # a default stop token (tokenizer's eos)
    info: dict = dataclasses.field(default_factory=dict)  # shown on /v1/models
    # Extra step counters for /metrics, e.g. a GraphRunner's {"graph_replays", "piecewise_steps",
    # "eager_steps"}; merged over Engine.stats() (which has none of them while no runner is wired).
    counters: Callable[[], dict] | None = None


def _pools(registry: LayerRegistry, options: EngineOptions, max_model_len: int, weight_bytes: int,
           device, ranks: int) -> tuple[KVPool, StatePool, SnapshotPool | None, str]:
    """The pools of one device (of one rank, for a tensor-parallel artifact: `registry` is a rank's),
    planned from the budget or sized by the options (checked against the device's free memory
    before they exist), and the lines that say what they take. With speculative decoding (D > 0)
    the state pool holds the verify steps' intermediate states and every request D more positions."""
    D = options.speculative_tokens
    if options.memory_budget_bytes is not None:
        plan = plan_memory(registry, budget_bytes=options.memory_budget_bytes, weight_bytes=weight_bytes,
                           max_seq_len=max_model_len, page_size=options.page_size, num_slots=options.slots,
                           max_running=options.max_running, draft_tokens=D,
                           snapshot_share=options.snapshot_share if options.prefix_cache else 0, ranks=ranks)
        snapshots = build_snapshot_pool(registry, plan, device) if options.prefix_cache else None
        return *build_pools(registry, plan, device), snapshots, "memory plan\n" + plan.table()
    # A verify step writes D positions past a request's last token (runtime/cache/memory_planner.py).
    pages = options.kv_pages or options.slots * pages_for(max_model_len + D, options.page_size)
    count = 0
    if options.prefix_cache:
        count = options.slots if options.prefix_snapshots is None else options.prefix_snapshots
    verify_rows = min(options.slots, options.max_running or options.slots) if D else 0
    parts = pool_bytes(registry, num_slots=options.slots, num_pages=pages, page_size=options.page_size,
                       num_snapshots=count, draft_tokens=D, verify_rows=verify_rows)
    check_fits(parts, device, ranks, fix="lower --slots, --kv-pages or --max-model-len, or size the pools with "
                                         "--memory-budget-gb")
    snapshots = SnapshotPool(registry, count, device) if options.prefix_cache else None
    said = (f"memory{'' if ranks == 1 else f' per rank of tensor parallel {ranks}'}: "
            f"{describe_bytes({'weights': weight_bytes, **parts})} ({options.slots} slots, {count} snapshots, "
            f"{pages} KV pages of {options.page_size} tokens)")
    return (KVPool(registry, pages, options.page_size, device),
            StatePool(registry, options.slots, device, draft_tokens=D, verify_rows=verify_rows), snapshots, said)


def _limits(options: EngineOptions, state_pool: StatePool, max_model_len: int) -> dict:
    """What the engine can send a step runner: max_running, token_budget, max_seq_len."""
    return {"max_running": min(options.max_running or state_pool.num_slots, state_pool.num_slots),
            "token_budget": options.token_budget, "max_seq_len": max_model_len}


def _prefix_cache(kv_pool: KVPool, state_pool: StatePool, snapshots: SnapshotPool | None,
                  options: EngineOptions) -> PrefixCache | None:
    """A prefix cache over the pools, unless it is turned off (no snapshot pool)."""
    if snapshots is None:
        return None
    return PrefixCache(kv_pool, state_pool, snapshots, PrefixCacheConfig(snapshot_interval=options.snapshot_interval))


def _engine(runner, kv_pool: KVPool, state_pool: StatePool, options: EngineOptions, max_model_len: int, device,
            **parts) -> Engine:
    return Engine(runner, kv_pool, state_pool, max_tokens_per_step=options.token_budget,
                  max_running=options.max_running, max_seq_len=max_model_len, device=device,
                  decodes_apart_from=options.decodes_apart_from, **parts)


def build_engine(registry: LayerRegistry, bind: Callable[[BoundOps], Callable], options: EngineOptions,
                 max_model_len: int, *, backend_factory: Callable, weight_bytes: int = 0,
                 device: str | torch.device = "cpu", log: Callable[[str], None] = lambda line: None) -> Engine:
    """The Engine of an eager model (a family model over its registry; tests): pools, the backend
    `backend_factory(kv_pool, state_pool)` makes, its op table, `bind(ops)` as the forward of an
    EagerRunner, a prefix cache. An artifact's engine is `engine_for_artifact`'s (graph runners,
    drafts)."""
    if options.speculative_tokens:
        raise ValueError("build_engine: speculative decoding runs an artifact's draft program: use engine_for_artifact")
    kv_pool, state_pool, snapshots, memory = _pools(registry, options, max_model_len, weight_bytes, device, 1)
    ops = BoundOps(backend_factory(kv_pool, state_pool))
    log(memory)  # once the backends are bound: a refusal there stays the one line it is
    runner = EagerRunner(bind(ops), ops, kv_pool, device, options.token_budget)
    return _engine(runner, kv_pool, state_pool, options, max_model_len, device,
                   prefix_cache=_prefix_cache(kv_pool, state_pool, snapshots, options),
                   overlap=options.overlap)


def engine_for_artifact(art, options: EngineOptions, max_model_len: int, *, device: str | torch.device = "cpu",
                        backend_factory: Callable | None = None, graphs=True, registry=None,
                        log: Callable[[str], None] = lambda line: None, progress=None, tp_lead=None,
                        drafter_wrap: Callable | None = None, fixed_draft_products: bool = False) -> Engine:
    """The Engine of a loaded artifact, read top to bottom: the device check, the pools (planned or
    sized), the backends its routing.json names, the main step runner (captured and parity-checked),
    the drafter, the compiled pieces' check, the prefix cache, the engine.

    backend_factory(kv_pool, state_pool) -> a caller's one backend for every node, draft included
    (default: the instances routing.json names, from `registry`, default runtime.backends.discover()).
    graphs: True, a GraphRunner over CUDA graphs on CUDA and none on the CPU; False, none (every
    step eager); or the capture backend of a GraphRunner on any device (testkit's RerunGraphs, the
    CPU stand-in). `progress`: a tqdm-like factory, a bar over its captures. tp_lead: rank 0's
    RankGroup of a tensor-parallel run: every step goes to the other ranks (runtime/dist/distributed.py).
    drafter_wrap(drafter) -> the drafter the engine uses (a benchmark's or a test's proposer around the
    artifact's); fixed_draft_products: the draft's graphs keep the fixed-order products under
    --batch-invariant (a benchmark's same-call baseline; `_draft_runner`)."""
    _check_device(art, device)
    D = options.speculative_tokens
    if D:
        check_drafter(art)
    weight_bytes = sum(t.nbytes for t in art.weights.values())
    with art.compiled.watch() if art.compiled is not None else contextlib.nullcontext():
        kv_pool, state_pool, snapshots, memory = _pools(art.registry, options, max_model_len, weight_bytes, device,
                                                        art.docs.tp)
        ops, draft_ops = _bound_ops(art, kv_pool, state_pool, snapshots, registry, backend_factory)
        log(memory)  # once the backends are bound: a refusal there stays the one line it is
        limits = _limits(options, state_pool, max_model_len)
        capture = _capture(graphs, device)
        if capture is None:
            runner = EagerRunner(art.bind(ops, "main", all_outputs=bool(D)), ops, kv_pool, device,
                                 options.token_budget)
        else:
            runner = _graph_runner(art, ops, kv_pool, state_pool, limits, D, capture, log, progress)
        spec = None
        if D:
            spec = _speculative_decoder(art, draft_ops, runner, kv_pool, state_pool, D, options.token_budget,
                                        fixed_draft_products, log)
            if drafter_wrap is not None:
                spec.drafter = drafter_wrap(spec.drafter)
        if art.compiled is not None and capture is None:
            reports = compiled_start_up_parity(runner, spec, kv_pool, state_pool, _vocab_size(art),
                                               options.token_budget)
            art.compiled.parity = reports
            worst = max(o["rel_err"] for r in reports for o in r["ops"]) if reports else 0.0
            log(f"compiled pieces ({art.compiled.key}) match the traced glue: worst op input rel err {worst:.2g}, "
                f"logits {max(r['logits'] for r in reports):.2g}")
    # after start-up: its capture and parity changed the pools on every rank alike, and are not sent
    broadcast = lead(tp_lead, kv_pool, state_pool, snapshots, D) if tp_lead is not None else None
    kernel_watch = None
    if art.compiled is not None and torch.device(device).type == "cuda":  # the process's caches are the bundle's copy
        kernel_watch = art.compiled.serving_watch(log)
    overlap = options.overlap
    if overlap and broadcast is not None:
        log("tensor parallel: the overlapped schedule is off (the other ranks run each step with its ids on the host)")
        overlap = False
    if art.batch_invariant:  # a decoding request's row never goes through a mixed forward (Engine, "Decodes apart")
        options = dataclasses.replace(options, decodes_apart_from=1)
    return _engine(runner, kv_pool, state_pool, options, max_model_len, device,
                   prefix_cache=_prefix_cache(kv_pool, state_pool, snapshots, options), speculative=spec,
                   broadcast=broadcast, kernel_watch=kernel_watch, overlap=overlap)


def _check_device(art, device) -> None:
    """The device must be the one the artifact was compiled for (its routing target)."""
    target = art.docs.routing.target
    if torch.device(device).type != torch.device(target).type:
        raise ValueError(f"{art.docs.path}: compiled for target {target!r} (its routing.json binds {target} "
                         f"backends), asked to run on {device!r}: pass --device {target}, or recompile with "
                         f"--target {torch.device(device).type}")


def _bound_ops(art, kv_pool: KVPool, state_pool: StatePool, snapshots: SnapshotPool | None, registry,
               backend_factory: Callable | None) -> tuple[BoundOps, BoundOps]:
    """The op tables of the main and the draft program: over the instances routing.json names, built
    once over the pools for both programs (runtime/artifact/binding.py), each program's own
    BackendSet, so each draft node is bound to the instance its entry names and the draft's per-step
    hooks reach every instance owning a draft node; or both over a caller's one backend (made
    without the snapshot pool: its steps write no snapshots, so the prefix cache ends chunks there)."""
    if backend_factory is not None:
        ops = BoundOps(backend_factory(kv_pool, state_pool))
        return ops, ops
    backends = art.backends(kv_pool, state_pool, registry, snapshots)
    ops = BoundOps(backends.for_program("main"))
    return ops, ops.sibling(backends.for_program("draft")) if "draft" in art.programs else ops


def _capture(graphs, device):
    """The capture backend of the main GraphRunner (None: no graph runner); see engine_for_artifact."""
    if graphs is False:
        return None
    if graphs is True:
        return CudaGraphs() if torch.device(device).type == "cuda" else None
    return graphs


def _is_build(art) -> bool:
    """Whether this start-up is a build's (`load_built`): its compiled pieces' kernels choose their
    launch configurations at their first launch and the bundle keeps the choices; a run loads them
    and runs no tuning step, so it launches nothing the build did not (GraphRunner's `tuning_step`
    says why the first launch matters)."""
    return art.compiled is not None and art.compiled.building


def _graph_runner(art, ops: BoundOps, kv_pool: KVPool, state_pool: StatePool, limits: dict, draft_tokens: int,
                  capture, log: Callable[[str], None], progress) -> GraphRunner:
    """The main program's GraphRunner, started: the artifact's recorded buckets (manifest "buckets")
    clipped to the engine's limits (`buckets_for`) are captured, then the start-up parity check runs:
    a mismatch raises ParityError before the engine exists, so nothing is served. With speculative
    decoding (D draft tokens) the decode buckets become target_verify buckets of D + 1 tokens per
    request, as many as the state pool's intermediate rows hold (a decoding request is always verified)."""
    recorded = art.manifest["buckets"]
    decode, extend = buckets_for(recorded["decode_batch_sizes"], recorded["extend_token_counts"],
                                 max_running=limits["max_running"], token_budget=limits["token_budget"],
                                 max_seq_len=limits["max_seq_len"])
    verify = ()
    if draft_tokens:
        rows = state_pool.verify_rows
        decode, verify = (), tuple(b for b in decode if b <= rows)
        if max(verify, default=0) < rows:  # a bucket past the intermediate states is not captured: say so
            log(f"target_verify buckets {', '.join(map(str, verify)) or 'none'}: verify steps of "
                f"{max(verify, default=0) + 1} to {rows} requests run eagerly (the intermediate states hold "
                f"{rows} requests, no recorded bucket equals that); a --max-running (or --slots) among the "
                f"artifact's decode buckets ({', '.join(map(str, recorded['decode_batch_sizes']))}) captures them all")
    runner = GraphRunner(art.runner(ops, "main"), ops, kv_pool, state_pool, kv_pool.device,
                         decode_buckets=decode, extend_buckets=extend,
                         max_pages_per_seq=kv_pool.pages_for(limits["max_seq_len"] + draft_tokens),
                         extend_max_seqs=extend_seqs(max(recorded["decode_batch_sizes"], default=1), extend),
                         chunk_size=limits["token_budget"],
                         graphs=capture, verify_buckets=verify, verify_tokens=draft_tokens + 1,
                         tuning_step=_is_build(art))
    runner.start(_vocab_size(art), log=log, progress=progress)
    if art.compiled is not None:
        art.compiled.parity = list(runner.parity.compiled.values())
    return runner


def _speculative_decoder(art, draft_ops: BoundOps, main, kv_pool: KVPool, state_pool: StatePool, draft_tokens: int,
                         chunk_size: int, fixed_draft_products: bool, log: Callable[[str], None]) -> SpeculativeDecoder:
    """The artifact's draft program as the drafter, over the main step runner: eager steps beside an
    EagerRunner, a GraphRunner of its own beside a GraphRunner (`_draft_runner`)."""
    if isinstance(main, GraphRunner):
        steps = _draft_runner(art, draft_ops, main, kv_pool, state_pool, draft_tokens, fixed_draft_products, log)
    else:
        steps = EagerRunner(art.bind(draft_ops, "draft"), draft_ops, kv_pool, kv_pool.device, chunk_size,
                            takes_hidden=True)
    hidden_size, dtype = hidden_input_spec(art.programs["draft"])
    drafter = MTPDrafter(steps, draft_tokens, state_pool.num_slots, hidden_size, dtype, kv_pool.device)
    return SpeculativeDecoder(main, drafter, draft_tokens, state_pool)


def _draft_runner(art, draft_ops: BoundOps, main: GraphRunner, kv_pool: KVPool, state_pool: StatePool,
                  draft_tokens: int, fixed_draft_products: bool, log: Callable[[str], None]) -> GraphRunner:
    """The draft program's GraphRunner, started: decode buckets for the chain, the main runner's
    verify buckets for the draft after verify, its extend buckets after prefill chunks. It captures
    into the main runner's graph pool; instances shared with the main program keep the static
    buffers the main runner allocated (sized for both), one owning draft nodes only gets its own;
    it is parity-checked like the main one before anything is served. Under --batch-invariant its
    graphs hold torch's products (runtime/engine/speculative.py); `fixed_draft_products` keeps the
    fixed-order ones there too."""
    steps = GraphRunner(art.runner(draft_ops, "draft"), draft_ops, kv_pool, state_pool, kv_pool.device,
                        decode_buckets=main.verify_buckets, extend_buckets=main.extend_buckets,
                        max_pages_per_seq=main.max_pages, extend_max_seqs=main.extend_max_seqs,
                        chunk_size=main.chunk_size, graphs=main.graphs,
                        verify_buckets=main.verify_buckets, verify_tokens=draft_tokens + 1,
                        verify_logits_rows=1, tuning_step=main.tuning_step)
    if steps.max_tokens > main.max_tokens or steps.max_seqs > main.max_seqs:
        raise ValueError(f"the draft's graph buckets ({steps.max_tokens} tokens, {steps.max_seqs} requests) "
                         f"exceed the main runner's static buffers ({main.max_tokens}, {main.max_seqs})")
    shared = members_of(main.ops.backend)
    for key, member in members_of(draft_ops.backend).items():
        if key not in shared:  # owns draft nodes only: the main runner sized no buffers for it
            member.init_capture_state(steps.max_tokens, steps.max_seqs)
    products = contextlib.nullcontext() if fixed_draft_products else batch_invariant_aten.products_to_torch()
    with products:
        steps.capture(init_backend=False, pool=main.state.pool)
        report = check_parity(steps, vocab_size=_vocab_size(art))
    if art.compiled is not None:  # the draft's compiled pieces, checked per key
        art.compiled.parity += [{**r, "key": f"draft {r['key']}"} for r in steps.parity.compiled.values()]
    log(f"draft program: captured {len(steps.keys)} graphs; start-up parity: {len(report)} keys match eager")
    return steps


def compiled_start_up_parity(runner: EagerRunner, spec: SpeculativeDecoder | None, kv_pool: KVPool,
                             state_pool: StatePool, vocab_size: int, chunk_size: int) -> list[dict]:
    """Without a GraphRunner: each program the engine runs, its compiled pieces against its traced
    glue on a few steps (runtime/graphs/compiled_parity.py); the draft's reports are named as such."""
    reports = check_compiled_start_up(runner.forward.runner, runner.ops, kv_pool, state_pool, vocab_size, chunk_size)
    if spec is not None:  # the draft (MTP) program, run by an EagerRunner too
        steps = spec.drafter.steps
        reports += [{**r, "key": f"draft {r['mode']}"} for r in check_compiled_start_up(
            steps.forward.runner, steps.ops, kv_pool, state_pool, vocab_size, chunk_size)]
    return reports


def _manifest_int(manifest: dict, *names: str) -> int | None:
    """The first of `names` found as an integer in the manifest's model facts or its config.json copy."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    for doc in (manifest.get("model"), config.get("text_config"), config):
        if isinstance(doc, dict):
            for name in names:
                value = doc.get(name)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
    return None


def _vocab_size(art) -> int:
    found = _manifest_int(art.manifest, "vocab_size")
    if found is not None:
        return found
    # The output projection's rows are the vocabulary, whatever the manifest records.
    for fqn, tensor in art.weights.items():
        if fqn.endswith(("lm_head.weight", "embed_tokens.weight", "word_embeddings.weight")):
            return int(tensor.shape[0])
    raise ValueError(f"{art.docs.path}: cannot tell the vocabulary size (no vocab_size in manifest.json, "
                     f"no lm_head weight)")


def check_served_inputs(artifact: str | os.PathLike, options: EngineOptions,
                        tokenizer_dir: str | os.PathLike | None = None) -> tuple[TextTokenizer | None, int]:
    """(the tokenizer of `tokenizer_dir` or None, the longest request served) where the flags and
    the artifact's documents allow them; raises the one-line refusal where they do not: a bad
    --tokenizer first, then a folder that is no artifact (LoadError), then a --max-model-len past the
    model's positions. Reads the documents only (their hashes are the loader's to check), so a
    refusal costs no load of weights or programs, nor in a split `hgc serve` a start of the
    engine core."""
    from runtime.artifact.docs import read_artifact

    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = TextTokenizer.from_dir(tokenizer_dir)
        if tokenizer is None:
            raise ValueError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
    manifest = read_artifact(artifact, verify_hashes=False).manifest
    model_len = _manifest_int(manifest, "max_position_embeddings")
    max_model_len = options.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_len or DEFAULT_MAX_MODEL_LEN)
    if model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {model_len} positions")
    return tokenizer, max_model_len


def load_served_model(artifact: str | os.PathLike, *, name: str | None = None,
                      options: EngineOptions = EngineOptions(), tokenizer_dir: str | os.PathLike | None = None,
                      device: str | torch.device | None = None, backend_factory: Callable | None = None,
                      graphs: bool = True, compiled=None, log: Callable[[str], None] = lambda line: None,
                      progress=None, rank: int = 0, tp: int = 1, load_format: str = "auto",
                      tp_lead=None) -> ServedModel:
    """The backends are those routing.json names; on a CUDA device with `graphs`, every step goes
    through a GraphRunner started (captured and parity-checked) here, before anything is served.
    `compiled`: CompiledOptions for the artifact's target bundle (default: run it if this
    installation built it). `progress`: a tqdm-like factory, for bars over the weights and the captures.
    `rank` of `tp`, `load_format`: which weights to load (runtime/artifact/loader.load_artifact);
    `tp_lead`: rank 0's RankGroup (engine_for_artifact)."""
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact, programs_for_run

    tokenizer, max_model_len = check_served_inputs(artifact, options, tokenizer_dir)
    # device None: the artifact's target
    art = load_artifact(artifact, device=device, progress=progress, compiled=compiled or CompiledOptions(),
                        rank=rank, tp=tp, load_format=load_format,
                        programs=programs_for_run(options.speculative_tokens))
    device = art.device
    if tokenizer is None:
        # After the load: the artifact's tokenizer files are listed in its manifest, so their hashes
        # were checked with everything else.
        tokenizer = TextTokenizer.from_dir(artifact)
    vocab_size = _vocab_size(art)
    engine = engine_for_artifact(art, options, max_model_len, device=device, backend_factory=backend_factory,
                                 graphs=graphs, log=log, progress=progress, tp_lead=tp_lead)
    if tokenizer is not None and tokenizer.max_token_id >= vocab_size:
        raise ValueError(f"{tokenizer.source}: the tokenizer has token id {tokenizer.max_token_id}, outside the "
                         f"model's vocabulary of {vocab_size}")
    eos = tokenizer.eos_token_id if tokenizer is not None else _manifest_int(art.manifest, "eos_token_id")
    return ServedModel(
        name=name or Path(artifact).resolve().name, engine=engine, vocab_size=vocab_size,
        max_model_len=engine.max_seq_len, tokenizer=tokenizer, eos_token_id=eos,
        info={"family": art.docs.family, "device": str(device)})  # no server path: every client sees it
