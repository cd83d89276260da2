"""What the server serves: one model behind an Engine, with its limits and its tokenizer.

1. `EngineOptions` holds the serving knobs (`hgc serve` flags): slots, running cap, token budget per
   step, page size, KV pages or a memory budget, the longest request, the prefix cache.
2. `build_engine(registry, bind, options, backend_factory=...)` sizes the pools (the memory planner
   when a budget is given, else explicit slots and pages; with speculative decoding, the
   intermediate states and D more positions per request), makes the backend and its BoundOps,
   asks `bind(ops)` for the forward callable, and builds the Engine, with a prefix cache unless it
   is turned off and a speculative decoder (runtime/engine/speculative.py, the artifact's draft program)
   with `speculative_tokens`.
3. `load_served_model(artifact)` does that for a compiled artifact (runtime/artifact/loader.py), finds the
   tokenizer in the artifact folder (or `tokenizer_dir`), and returns a `ServedModel`. Tests build
   a ServedModel over an eager model with the same `build_engine`.

The backends of an artifact are the ones its routing.json names, built over the pools and bound
node by node (runtime/artifact/binding.py); nothing here picks a backend by device. The device must be the
one the artifact was compiled for (its routing target). On "cuda", unless `graphs=False`, a
GraphRunner captures the artifact's buckets and checks them against eager before the engine takes
a request. An artifact whose compiled pieces were loaded (runtime/artifact/bundle.py) starts inside the
bundle's KernelWatch (a kernel built or tuned at start-up is an error naming it), and without a
GraphRunner its pieces are checked against the traced glue here (runtime/graphs/compiled_parity.py).
An eager model (tests) passes its own `backend_factory(kv_pool, state_pool) -> backend`.

It does not run anything: the EngineLoop (app.py) steps the engine.
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
from runtime.cache.kv_pool import KVPool, pages_for
from runtime.cache.memory_planner import (build_pools, build_snapshot_pool, check_fits, describe_bytes, plan_memory,
                                    pool_bytes)
from runtime.cache.prefix_cache import DEFAULT_SNAPSHOT_INTERVAL, PrefixCache, PrefixCacheConfig
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool
from runtime.artifact.tokenizer import TextTokenizer

__all__ = ["EngineOptions", "ServedModel", "build_engine", "engine_for_artifact", "compiled_start_up_parity",
           "routed_backends", "load_served_model", "DEFAULT_MAX_MODEL_LEN"]

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
        from runtime.engine.speculative import MAX_DRAFT_TOKENS
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


def build_engine(registry: LayerRegistry, bind: Callable[[BoundOps], Callable], options: EngineOptions,
                 max_model_len: int, *, backend_factory: Callable, weight_bytes: int = 0,
                 device: str | torch.device = "cpu", runner_factory: Callable | None = None,
                 speculative_factory: Callable | None = None, ranks: int = 1, prompts_apart: bool = False,
                 log: Callable[[str], None] = lambda line: None) -> Engine:
    """Pools, backend, op table and Engine for one model; `bind(ops)` returns its forward.

    backend_factory(kv_pool, state_pool) -> the backend the op table calls (for an artifact: the
    BackendSet of the instances its routing.json names). runner_factory(ops, kv_pool, state_pool,
    engine_limits) -> a started GraphRunner, whose dispatcher then runs every step (engine_limits:
    max_running, token_budget, max_seq_len). speculative_factory(ops, kv_pool, state_pool,
    engine_limits, runner) -> a SpeculativeDecoder (runtime/engine/speculative.py), with
    options.speculative_tokens > 0. ranks: the tensor-parallel rank count the registry and
    weights are one rank's (what the memory lines say). prompts_apart: the Engine's (an artifact
    compiled with --batch-invariant asks for it: LoadedArtifact.batch_invariant)."""
    if bool(options.speculative_tokens) != (speculative_factory is not None):
        raise ValueError("build_engine: speculative_tokens and a speculative_factory go together")
    kv_pool, state_pool, snapshots, memory = _pools(registry, options, max_model_len, weight_bytes, device, ranks)
    ops = BoundOps(backend_factory(kv_pool, state_pool))
    log(memory)  # once the backends are bound: a refusal there stays the one line it is
    runner = None
    limits = {"max_running": min(options.max_running or state_pool.num_slots, state_pool.num_slots),
              "token_budget": options.token_budget, "max_seq_len": max_model_len}
    if runner_factory is not None:
        runner = runner_factory(ops, kv_pool, state_pool, limits)
    speculative = speculative_factory(ops, kv_pool, state_pool, limits, runner) if speculative_factory else None
    prefix_cache = None
    if snapshots is not None:
        prefix_cache = PrefixCache(kv_pool, state_pool, snapshots,
                                   PrefixCacheConfig(snapshot_interval=options.snapshot_interval))
    return Engine(bind(ops), ops, kv_pool, state_pool, max_tokens_per_step=options.token_budget,
                  max_running=options.max_running, max_seq_len=max_model_len, device=device, runner=runner,
                  prefix_cache=prefix_cache, speculative=speculative, prompts_apart=prompts_apart)


def engine_for_artifact(art, options: EngineOptions, max_model_len: int, *, device: str | torch.device = "cpu",
                        backend_factory: Callable | None = None, graphs: bool = True, registry=None,
                        log: Callable[[str], None] = lambda line: None, progress=None) -> Engine:
    """The Engine of a loaded artifact: `build_engine` over the backends its routing.json names
    (`registry`: where their classes come from; default runtime.backends.discover()) and, on CUDA
    with `graphs`, a started GraphRunner (runtime/graphs/runner.graph_runner_factory; `progress`, a
    tqdm-like factory, draws a bar over its captures, kernel builds included); with
    options.speculative_tokens, the artifact's draft program as the drafter, its nodes bound to the
    same instances through the draft program's own BackendSet."""
    target = art.docs.routing.target
    if torch.device(device).type != torch.device(target).type:
        raise ValueError(f"{art.docs.path}: compiled for target {target!r} (its routing.json binds {target} "
                         f"backends), asked to run on {device!r}: pass --device {target}, or recompile with "
                         f"--target {torch.device(device).type}")
    D = options.speculative_tokens
    draft_backend = None  # a caller's own backend_factory: its one backend serves the draft too
    if backend_factory is None:
        backend_factory, draft_backend = routed_backends(art, registry)
    runner_factory = speculative = None
    if torch.device(device).type == "cuda" and graphs:
        from runtime.graphs.runner import graph_runner_factory
        runner_factory = graph_runner_factory(art, _vocab_size(art), speculative_tokens=D, log=log, progress=progress)
    if D:
        from runtime.engine.speculative import speculative_factory
        speculative = speculative_factory(art, D, draft_backend=draft_backend, log=log)
    weight_bytes = sum(t.nbytes for t in art.weights.values())
    with art.compiled.watch() if art.compiled is not None else contextlib.nullcontext():
        engine = build_engine(art.registry, art.bind, options, max_model_len, weight_bytes=weight_bytes, device=device,
                              backend_factory=backend_factory, runner_factory=runner_factory,
                              speculative_factory=speculative, ranks=art.docs.tp,
                              prompts_apart=art.batch_invariant, log=log)
        if art.compiled is not None and engine.runner is None:
            reports = compiled_start_up_parity(engine, _vocab_size(art), options.token_budget)
            art.compiled.parity = reports
            worst = max(o["rel_err"] for r in reports for o in r["ops"]) if reports else 0.0
            log(f"compiled pieces ({art.compiled.key}) match the traced glue: worst op input rel err {worst:.2g}, "
                f"logits {max(r['logits'] for r in reports):.2g}")
    if art.compiled is not None and torch.device(device).type == "cuda":  # the process's caches are the bundle's copy
        engine.kernel_watch = art.compiled.serving_watch(log)
    return engine


def compiled_start_up_parity(engine: Engine, vocab_size: int, chunk_size: int) -> list[dict]:
    """Without a GraphRunner: each program the engine runs, its compiled pieces against its traced
    glue on a few steps (runtime/graphs/compiled_parity.py); the draft's reports are named as such."""
    from runtime.graphs.compiled_parity import check_compiled_start_up

    reports = check_compiled_start_up(engine.forward.runner, engine.ops, engine.kv_pool, engine.state_pool,
                                      vocab_size, chunk_size)
    if engine.spec is not None:  # the draft (MTP) program, run eagerly by runtime/engine/speculative.EagerSteps
        steps = engine.spec.drafter.steps
        reports += [{**r, "key": f"draft {r['mode']}"} for r in check_compiled_start_up(
            steps.forward.runner, steps.ops, engine.kv_pool, engine.state_pool, vocab_size, chunk_size)]
    return reports


def routed_backends(art, registry=None) -> tuple[Callable, Callable]:
    """(backend_factory, draft_backend) for `build_engine` and `speculative_factory`: the instances
    the artifact's routing.json names, built once over the pools (runtime/artifact/binding.py), for both
    programs. backend_factory(kv_pool, state_pool) -> the main program's BackendSet;
    draft_backend() -> the draft program's, over the same instances."""
    built = {}

    def backend_factory(kv_pool, state_pool):
        built["backends"] = art.backends(kv_pool, state_pool, registry)
        return built["backends"].for_program("main")

    def draft_backend():
        return built["backends"].for_program("draft")

    return backend_factory, draft_backend


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


def load_served_model(artifact: str | os.PathLike, *, name: str | None = None,
                      options: EngineOptions = EngineOptions(), tokenizer_dir: str | os.PathLike | None = None,
                      device: str | torch.device | None = None, backend_factory: Callable | None = None,
                      graphs: bool = True, compiled=None, log: Callable[[str], None] = lambda line: None,
                      progress=None, rank: int = 0, tp: int = 1, load_format: str = "auto") -> ServedModel:
    """The backends are those routing.json names; on a CUDA device with `graphs`, every step goes
    through a GraphRunner started (captured and parity-checked) here, before anything is served.
    `compiled`: CompiledOptions for the artifact's target bundle (default: run it if this
    installation built it). `progress`: a tqdm-like factory, for bars over the weights and the captures.
    `rank` of `tp`, `load_format`: which weights to load (runtime/artifact/loader.load_artifact)."""
    from runtime.artifact.loader import load_artifact, programs_for_run

    tokenizer = None
    if tokenizer_dir is not None:  # first: a bad --tokenizer fails before seconds of loading programs
        tokenizer = TextTokenizer.from_dir(tokenizer_dir)
        if tokenizer is None:
            raise ValueError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
    from runtime.artifact.bundle import CompiledOptions
    # device None: the artifact's target
    art = load_artifact(artifact, device=device, progress=progress, compiled=compiled or CompiledOptions(),
                        rank=rank, tp=tp, load_format=load_format,
                        programs=programs_for_run(options.speculative_tokens))
    device = art.device
    if tokenizer is None:
        # After the load: the artifact's tokenizer files are listed in its manifest, so their hashes
        # were checked with everything else.
        tokenizer = TextTokenizer.from_dir(artifact)
    model_len = _manifest_int(art.manifest, "max_position_embeddings")
    max_model_len = options.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_len or DEFAULT_MAX_MODEL_LEN)
    if model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {model_len} positions")
    vocab_size = _vocab_size(art)
    engine = engine_for_artifact(art, options, max_model_len, device=device, backend_factory=backend_factory,
                                 graphs=graphs, log=log, progress=progress)
    if tokenizer is not None and tokenizer.max_token_id >= vocab_size:
        raise ValueError(f"{tokenizer.source}: the tokenizer has token id {tokenizer.max_token_id}, outside the "
                         f"model's vocabulary of {vocab_size}")
    eos = tokenizer.eos_token_id if tokenizer is not None else _manifest_int(art.manifest, "eos_token_id")
    return ServedModel(
        name=name or Path(artifact).resolve().name, engine=engine, vocab_size=vocab_size,
        max_model_len=engine.max_seq_len, tokenizer=tokenizer, eos_token_id=eos,
        info={"family": art.docs.family, "device": str(device)})  # no server path: every client sees it
