"""TritonMoEBackend: the `moe` op on CUDA through the fused Triton MoE kernels, capturable in every mode.

The kernels and their launches are runtime/backends/kernels/moe.py (imported on the first
op call, so this module, which the registry imports for `capability` on any machine, needs no
triton); their tiles per token bucket come from runtime/backends/kernels/moe_config.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Optional

import torch

from compiler.splitops import MODES, BackendCapability, Mode
from runtime.backends.kernels.moe_config import (CONFIG_DIR, FIXED_CONFIG, FIXED_LOGITS_KERNEL, MoEConfig,
                                                 check_count_ranks, config_file_name, default_config, device_name_of,
                                                 fit_shared_memory, load_config_table, pick_bucket)
from runtime.backends.kernels.launch_math import cdiv, triton_interpreted
from runtime.backends.protocol import BackendHooks, BackendSetup

__all__ = ["TritonMoEBackend", "CaptureError"]


def _kernels():
    return importlib.import_module("runtime.backends.kernels.moe")


@dataclasses.dataclass(frozen=True)
class MoELayerShape:
    """What a moe call's launch choices depend on besides its token count."""

    experts: int  # E, routed
    inter: int  # I, one routed expert's width
    hidden: int  # D
    top_k: int
    slots: int  # pairs per token: top_k + the shared expert's chunks of width I
    dtype: str  # the activations' and weights' (torch's name): which downs split, the tiles' shared-memory fit

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @classmethod
    def of(cls, call) -> "MoELayerShape":
        """From a moe node's CallFacts (compiler/splitops/ops.py)."""
        E, two_i, D = call.shapes["w13"]
        shared = call.shapes.get("shared_w13")
        S = shared[0] // 2 if shared else 0
        top_k = int(call.scalars["top_k"])
        return cls(E, two_i // 2, D, top_k, top_k + cdiv(S, two_i // 2), call.dtype)  # `out`'s, the weights' too


class CaptureError(RuntimeError):
    """The moe op was captured without the static padding count that replays must read."""


# The gemm_tiles routing option's choices, the default first (the capability's comment says what each does).
GEMM_TILES = ("tuned", "fixed")
# The router option's choices, the default first: the routing of a token-path step in its gate-up
# kernel (below), others as "split"; past the GEMV's bound the router GEMM in slices of D with the
# last slice routing (one launch, kernels/moe.py `_split_router_kernel`; shorter steps as
# two_launches); the router's GEMV or GEMM then a routing kernel (two launches); the GEMV's last
# program routing (one launch, kernels/moe.py `router_folds`), and past the GEMV the split router.
# Why the split router past the GEMV: on an H100, in one call, bench qwen3_next's router took 110.6 against
# 160.9 us a 512-token step (12 layers) and 174.9 against 225.5 at 4096
# (benchmarks/kernels/account_diff.py on the raw accounts of
# benchmarks/results/step_account_options_h100_2026-12-06.md: the split router's row against the
# logits GEMM's and the routing kernel's).
# "in_experts" (the default): a token-path step (a few tokens: the tuned configs' first buckets)
# runs the GEMV, then a gate-up kernel whose programs route their own pairs from its logits
# (kernels/moe.py `route_in_gate_up`): a launch a layer fewer than the GEMV and the routing kernel;
# other steps as "split". Why the default: on an H100, in one call, a batch-1 step's gate-up kernel
# took 122.5 us with the routing against 110.3 plus the routing kernel's 24.3 (12 layers), and the
# step 12 launches fewer (benchmarks/results/step_account_in_experts_folds_ab_h100_2026-12-07.md).
ROUTERS = ("in_experts", "split", "two_launches", "one_launch")
# The sort_ranks option's choices, the default first: how the sort ranks each block's pairs
# (kernels/moe.py `_place_pairs`): a sort of their keys, or a running count (up to 64 expert bins).
SORT_RANKS = ("sorted", "counted")
# The down option's choices, the default first: a sorted step's down projections as the sorted
# kernel and the combine, or from kernels/moe.py SPLIT_DOWN_MIN_TOKENS tokens as the split down
# (`down_split`: torch's grouped GEMM over the routed rows, the shared expert as one dense GEMM,
# the combine through the sort's inverse map).
DOWNS = ("sorted", "split")
# The experts option's choices, the default first: a token-path step that routes in its experts
# (router "in_experts") runs gate-up and down as two launches, or as one (kernels/moe.py
# `experts_token`: the down programs load their weights while the gate-up programs run, then wait
# for their token's h), where the down tile covers the expert width in one step. Why not the
# default: on an H100, in one call, bench qwen3_next's batch-1 step took 0.983 ms with it against
# 0.925 (the one kernel 269.2 us a step against 121.2 + 81.2;
# benchmarks/results/step_account_experts_one_launch_ab_h100_2026-12-07.md).
EXPERTS = ("two_launches", "one_launch")


class TritonMoEBackend(BackendHooks):
    """Serves hgc.moe on CUDA with the kernels above (on the CPU too, under TRITON_INTERPRET=1).

    Lifecycle (runtime/backends/protocol.py):

    1. `TritonMoEBackend(config_dir=None)`: configs are read from `config_dir` (default
       runtime/backends/kernels/moe_configs/) on first use per (E, I, device) and kept on the instance.
    2. `init_capture_state(max_tokens, max_seqs)`: nothing to allocate.
    3. `init_replay_state(ctx, bucket)`: points the step's op calls at its real token count on the
       device, `ctx.query_start_loc[ctx.num_seqs]` (a padded request owns no rows, so the last
       offset is the real token count). That tensor is one of the graph runner's static step
       buffers, refilled before every replay, so a replayed graph reads each step's count from it
       and skips and zeroes that step's padding rows; the hook launches nothing, and a whole-step
       graph records it (`replay_state_in_graph`), so a replay calls nothing on this backend.
       `init_step_metadata(ctx)`: an eager step passes ctx.num_real_tokens as a launch argument.
    4. `moe(ctx, ...)`: host-side shape checks, then launches whose grids depend on shapes only.
       Each kernel variant is compiled by its first eager launch (the runtime's warm-up); capture
       after that. Capturing a step that went through no `init_replay_state` is refused
       (CaptureError): its padding count would be frozen into the graph.

    Rows at or past the real token count are routed to no expert (no weight is read for them)
    and come out zero. With ctx None (benchmarks, tests) every row is real.
    """

    name = "triton_moe"
    capability = BackendCapability(
        name="triton_moe", device="cuda", ops=frozenset({"moe"}),
        modes_supported=frozenset(MODES), modes_capturable=frozenset(MODES),
        # gemm_tiles: "tuned" picks tiles and the router's logits kernel by the step's token count
        # (moe_configs/); "fixed" uses one of each for every count (moe_config.FIXED_CONFIG), so a
        # token's result does not depend on what shares its step.
        # router: "in_experts" (the default) routes a token-path step inside its gate-up kernel (after
        # the GEMV) and other steps as "split" does; "split" runs a step past 128 tokens as the GEMM
        # in slices of D, the last slice of each row block routing it (one launch; under 64 experts),
        # shorter ones as the GEMV and the routing kernel; "two_launches" the GEMM, then the routing
        # kernel; "one_launch" runs the logits and the routing as one launch where the GEMV takes the
        # logits (kernels/moe.py router_folds: the GEMV's last program routes, and sorts, a step of
        # tokens that fit one routing tile), and past 128 tokens the split router as "split" does.
        # sort_ranks: "counted" ranks each block's pairs by a running count, not a sort (the same
        # layout; up to 64 experts with the shared expert's chunks).
        # down: "split" runs a step of 2048 tokens or more (bf16 on a GPU) through torch's grouped
        # GEMM for the routed experts and one dense GEMM for the shared expert.
        # experts: "one_launch" runs a token-path step's gate-up and down as one launch where the
        # router is "in_experts" (kernels/moe.py experts_token); other steps as before.
        options=(("gemm_tiles", GEMM_TILES), ("router", ROUTERS), ("sort_ranks", SORT_RANKS), ("down", DOWNS),
                 ("experts", EXPERTS)),
        batch_invariant=(("gemm_tiles", "fixed"),),
        doc="Fused Triton MoE: device-side top-k routing, static-shape token sorting, grouped expert "
            "GEMMs (the shared expert as extra experts) with SiLU-and-mul and weighted combine; no host "
            "sync, capturable in every mode")

    def __init__(self, config_dir: "str | os.PathLike | None" = None, device: "str | torch.device" = "cuda",
                 layers: tuple[MoELayerShape, ...] = (), gemm_tiles: str = GEMM_TILES[0], router: str = ROUTERS[0],
                 sort_ranks: str = SORT_RANKS[0], down: str = DOWNS[0], experts: str = EXPERTS[0]):
        """layers: the shapes of the moe calls this instance serves (`build` reads them off the
        graph); `kernel_variant_tokens` needs them, nothing else does. gemm_tiles: the capability's
        option ("fixed": FIXED_CONFIG and the GEMV router for every token count; config_dir unused).
        router, sort_ranks, down, experts: the capability's options (fixed tiles never fold the sort, so never
        take one launch, keep the GEMV router at every count, and never split the down: a token's
        bits would change with the step's size)."""
        if gemm_tiles not in GEMM_TILES:
            raise ValueError(f"{self.name}: gemm_tiles must be one of {GEMM_TILES}, not {gemm_tiles!r}")
        if router not in ROUTERS:
            raise ValueError(f"{self.name}: router must be one of {ROUTERS}, not {router!r}")
        if sort_ranks not in SORT_RANKS:
            raise ValueError(f"{self.name}: sort_ranks must be one of {SORT_RANKS}, not {sort_ranks!r}")
        if down not in DOWNS:
            raise ValueError(f"{self.name}: down must be one of {DOWNS}, not {down!r}")
        if experts not in EXPERTS:
            raise ValueError(f"{self.name}: experts must be one of {EXPERTS}, not {experts!r}")
        counted = sort_ranks == "counted"
        for layer in layers if counted else ():
            check_count_ranks(layer.experts + layer.slots - layer.top_k)  # routed experts and shared chunks
        self.fixed_tiles = gemm_tiles == "fixed"
        self.one_launch_router = router == "one_launch"
        # one_launch folds the routing into the GEMV's launch where the GEMV takes the logits; past
        # that it takes the split router, one launch too, as split does: the GEMM's programs routing
        # their own rows (`_logits_route_kernel`) took 296 against the split router's 110 us of a
        # 512-token step on an H100, 286 against 177 at 4096 (DESIGN, "The batch-1 decode step's
        # launches"). Fixed tiles: the GEMV router at every count.
        self.split_router = router in ("split", "one_launch", "in_experts") and gemm_tiles != "fixed"
        # in_experts: only token-path steps, which fixed tiles never take (FIXED_CONFIG is sorted)
        self.route_in_experts = router == "in_experts"
        self.experts_one_launch = experts == "one_launch"
        self.count_ranks = counted
        self.split_down = down == "split" and gemm_tiles != "fixed"
        self.config_dir = Path(config_dir) if config_dir is not None else CONFIG_DIR
        self.device = torch.device(device)
        self.layers = tuple(dict.fromkeys(layers))
        self._tables: dict[tuple[int, int, str], Optional[dict[int, MoEConfig]]] = {}
        self._planned: Optional[tuple[object, torch.Tensor]] = None  # (ctx, its real token count on the device)
        self._variant_tokens: dict[int, tuple[int, ...]] = {}  # kernel_variant_tokens' answers, by max_tokens

    @classmethod
    def build(cls, setup: BackendSetup) -> "TritonMoEBackend":
        """The tuned configs of runtime/backends/kernels/moe_configs/, launches on the pools' device."""
        return cls(device=setup.device, layers=tuple(MoELayerShape.of(c) for c in setup.calls if c.op == "moe"),
                   gemm_tiles=setup.options.get("gemm_tiles", GEMM_TILES[0]),
                   router=setup.options.get("router", ROUTERS[0]),
                   sort_ranks=setup.options.get("sort_ranks", SORT_RANKS[0]),
                   down=setup.options.get("down", DOWNS[0]), experts=setup.options.get("experts", EXPERTS[0]))

    # -- hooks --------------------------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """With the split router, its arrival counters, one per row block of the largest step, and
        with the experts in one launch, two per token (a capture cannot grow them: arrivals.py);
        captured graphs read the real token count from the step buffers."""
        if self.split_router and self.layers and self.device.type == "cuda" and not triton_interpreted():
            kernels = _kernels()
            blocks = max(kernels.split_router_shape(max_tokens, layer.hidden)[0] for layer in self.layers)
            kernels.arrival_counters(self.device, blocks, "moe router")
        if self.experts_one_launch and self.layers and self.device.type == "cuda" and not triton_interpreted():
            _kernels().arrival_counters(self.device, 2 * max_tokens, "moe experts")  # two per token

    def init_replay_state(self, ctx, bucket: int) -> None:
        """The real token count of this step and of every replay of its graph: a view of the step's
        query_start_loc (its last offset), which the graph runner refills before each replay."""
        qsl = ctx.query_start_loc
        if qsl.device.type != self.device.type or qsl.dtype != torch.int32:
            raise RuntimeError(f"{self.name}: a replayed step's query_start_loc must be int32 on {self.device} "
                               f"(got {qsl.dtype} on {qsl.device}): the kernels read its real token count there")
        self._planned = (ctx, qsl[ctx.num_seqs:ctx.num_seqs + 1])

    def replay_state_in_graph(self, mode: Mode) -> bool:
        """init_replay_state launches nothing: a whole-step graph needs no call before its replay."""
        return Mode(mode) in self.capability.modes_capturable

    def kernel_variant_tokens(self, max_tokens: int) -> tuple[int, ...]:
        """The smallest token count of each launch variant an eager step of up to `max_tokens` picks
        (triton_moe_kernels.launch_variant: logits kernel, GEMM tiles, sort width), over every layer
        shape served here. Nothing under Triton's interpreter, which builds no kernel."""
        if not self.layers or triton_interpreted():
            return ()
        if max_tokens in self._variant_tokens:  # the draft's runner asks what the main one asked
            return self._variant_tokens[max_tokens]
        launch_variant = _kernels().launch_variant
        first: dict[tuple, int] = {}
        for layer in self.layers:
            fitted: dict[MoEConfig, MoEConfig] = {}
            for T in range(1, max_tokens + 1):
                raw = self.config_for(T, layer.experts, layer.inter, layer.hidden, layer.top_k, self.device)
                config = fitted.get(raw) or fitted.setdefault(raw, fit_shared_memory(raw, layer.torch_dtype.itemsize))
                variant = launch_variant(T, layer.experts, layer.hidden, layer.slots, config,
                                         self._logits_kernel_at(T, layer.experts, layer.hidden), self._fold,
                                         self.one_launch_router, self._splits_down(T, layer.torch_dtype),
                                         self.route_in_experts, self.experts_one_launch)
                first.setdefault((layer, variant), T)
        self._variant_tokens[max_tokens] = tuple(sorted(set(first.values())))
        return self._variant_tokens[max_tokens]

    def init_step_metadata(self, ctx) -> None:
        """Nothing to plan for an eager step: the real token count travels as a launch argument."""
        self._planned = None

    def init_chunk_metadata(self, ctx, chunk_size: int) -> None:
        """Nothing to plan: a step's MoE needs no chunking (its buffers are sized from T each call)."""

    # -- configs ------------------------------------------------------------------------------

    def config_path(self, E: int, I: int, device_name: str) -> Path:
        return self.config_dir / config_file_name(E, I, device_name)

    def _logits_kernel_at(self, T: int, E: int, D: int) -> str:
        """The router logits kernel a step of T tokens launches (fixed tiles: one for every count)."""
        if self.fixed_tiles:
            return FIXED_LOGITS_KERNEL
        return _kernels().logits_kernel_for(T, E, D, split=self.split_router)

    def _splits_down(self, T: int, dtype: torch.dtype) -> bool:
        """Whether a sorted step of T tokens takes the split down (the down option and its rule)."""
        return self.split_down and _kernels().splits_down(T, dtype, self.device)

    @property
    def _fold(self) -> Optional[bool]:
        """Whether a sorted step routes and sorts in one launch, or None: chosen per step from its
        token count. Never with fixed tiles: the one-program router reduces a token's scores in a
        layout that depends on the step's token count, so their bits could differ with it."""
        return False if self.fixed_tiles else None

    def config_for(self, T: int, E: int, I: int, D: int, top_k: int, device: torch.device) -> MoEConfig:
        if self.fixed_tiles:
            return FIXED_CONFIG
        key = (E, I, device_name_of(device))
        if key not in self._tables:
            path = self.config_path(*key)
            self._tables[key] = load_config_table(path) if path.is_file() else None
        table = self._tables[key]
        return default_config(T, E, I, D, top_k) if table is None else pick_bucket(table, T)

    # -- op -------------------------------------------------------------------------------------

    def moe(self, ctx, x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate, out, layer_id,
            top_k, scoring, renormalize, routed_scale, num_groups, topk_groups, config: Optional[MoEConfig] = None):
        n_real: "int | torch.Tensor | None" = None
        if ctx is not None:
            if self._planned is not None and self._planned[0] is ctx:
                n_real = self._planned[1]
            else:
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise CaptureError(
                        f"{self.name}: hgc.moe (layer {layer_id}) is being captured in a step that went through "
                        f"no init_replay_state; its real token count ({ctx.num_real_tokens}) would be frozen "
                        f"into the graph. Call init_replay_state before capture.")
                n_real = int(ctx.num_real_tokens)
        if config is None:
            config = fit_shared_memory(self.config_for(x.shape[0], w13.shape[0], w2.shape[-1], x.shape[1], top_k,
                                                       x.device), x.element_size())
        _kernels().fused_moe(x, router_weight, router_bias, w13, w2, shared_w13, shared_w2, shared_gate, out, top_k,
                             scoring, renormalize, routed_scale, num_groups, topk_groups, config, n_real=n_real,
                             logits_kernel=self._logits_kernel_at(x.shape[0], w13.shape[0], x.shape[1]),
                             fold=self._fold, one_launch_router=self.one_launch_router, count_ranks=self.count_ranks,
                             split_down=config.path == "sorted" and self._splits_down(x.shape[0], x.dtype),
                             route_in_experts=self.route_in_experts, experts_one_launch=self.experts_one_launch)
