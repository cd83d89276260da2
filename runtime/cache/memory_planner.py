"""Memory planner: split a device memory budget between weights, the state pool, the prefix cache's
snapshot pool and the KV pool.

It owns the arithmetic only; `build_pools` turns a plan into the pools. Lifecycle:

1. `CacheLayout.from_registry` reads, from the LayerRegistry (the single source of truth), the
   bytes one token costs in the KV pool (every kv entry of every full layer, draft layers
   included) and the bytes one slot costs in the state pool (every state entry of every linear
   layer). These are the same sums the pools allocate, so a plan's bytes equal the pools' nbytes.
2. `plan_memory` subtracts the weights and any reserved bytes (activations, graph pools) from the
   budget, gives the snapshot pool its share of what is left (`snapshot_share`, 0 without a
   prefix cache), sizes the state pool (explicit slot count, or a ratio of state to KV memory),
   and gives every remaining byte to the KV pool in whole pages.
3. It checks the plan holds at least `min_requests` requests of `max_seq_len` tokens (default 1)
   and raises `MemoryPlanError` naming the missing bytes otherwise.
4. `MemoryPlan.table()` prints the split; `build_pools(registry, plan)` allocates the KV and
   state pools, `build_snapshot_pool(registry, plan)` the snapshot pool.
5. Without a budget (explicit slots and pages), `pool_bytes` states what the pools will take and
   `check_fits` compares any parts (the weights before they are loaded, the pools before they are
   allocated) with what the device has free, raising `MemoryPlanError` with the shortfall rather
   than leaving a CUDA out-of-memory error halfway through start-up.

Formulas (s = state bytes per slot, t = KV bytes per token, P = page_size, D = draft tokens,
R = max_running, S = slots)::

    snapshots           N * s,  N = floor(snapshot_share * available / s)   # prefix cache
    main state          (S + 1) * s                      # +1: the reserved padding slot (slot 0)
    intermediate state  min(S, R) * D * s                # only with speculative decoding (D > 0)
    KV pages            floor((available - snapshots - state) / (P * t))
    available           budget - weights - reserved

A snapshot is one slot's worth of state (every linear layer's recurrent and convolution state),
so it costs s bytes. The prefix cache's KV pages are not a share of their own: the cache holds
pages of the KV pool and gives them back when requests need them (runtime/cache/radix_cache.py). With
no linear layers a snapshot costs nothing, and the pool gets one per KV page (a node of the cache
holds at least a page).

Speculative decoding (target verify): a request feeds D + 1 tokens (its last accepted token and
D drafts). The verify kernel writes the state after token i (i = 0 .. D-1) into intermediate
entry i of the request's row and the state after token D into the request's main slot. Once a
tokens are accepted (1 <= a <= D + 1), a <= D copies intermediate entry a-1 into the main slot.
So D entries per running request, not D + 1. Every state entry of every linear layer is
duplicated per draft token: the recurrent matrix and the conv window. The conv window after a
tokens could be rebuilt from the old window and the step's inputs, but verify overwrites the old
window in place and the inputs are gone after the step; the window is ~2% of a GDN layer's state,
so the planner keeps acceptance a plain copy.

Intermediate entries are indexed by a request's row in the verify batch, not by its slot: they
live for one step (verify writes them, acceptance reads them). So they are needed only for the
requests that can run at once, min(S, R), and the padding rows of a captured verify batch may
write rows that no real request uses in that step (the graph runner must keep its verify buckets
at or below min(S, R)). With a ratio, S is the largest slot count whose main + intermediate bytes
fit the state share (the joint solve); what the share does not use goes to the KV pool.

The minimum request: one slot (+ the padding slot), its D intermediate entries, and
ceil((max_seq_len + D) / P) pages: verify writes K/V for D draft tokens that may be rejected, so
a request at its last position still needs room for them.

Tensor parallel: every rank holds the same shapes (a rank's program, its registry and its weight
shard), so one plan per rank is the plan of every rank; the budget is one device's, and with
`ranks` > 1 the table and every shortfall say they are per rank.

`available_bytes(device)` is the memory a device has free now (the budget `hgc run` and
`hgc generate` check a request against before allocating anything).

It does not measure weights or activations (callers pass them) nor decide anything at run time:
the engine only ever sees the pools.
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction

import torch
from tabulate import tabulate

from compiler.splitops import LayerRegistry, dtype_from_name
from runtime.cache.kv_pool import KVPool, pages_for
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool

__all__ = ["CacheLayout", "MemoryPlan", "MemoryPlanError", "plan_memory", "build_pools", "build_snapshot_pool",
           "pool_bytes", "check_fits", "describe_bytes", "format_bytes", "available_bytes", "GiB"]

GiB = 1 << 30


class MemoryPlanError(ValueError):
    """The budget cannot hold the requested minimum; `missing_bytes` says by how much."""

    def __init__(self, message: str, missing_bytes: int):
        super().__init__(message)
        self.missing_bytes = missing_bytes


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Per-token KV bytes and per-slot state bytes of a registry, the planner's only model input."""

    kv_bytes_per_token: int  # over every full layer (main and draft)
    state_bytes_per_slot: int  # over every linear layer, one slot (the padding slot costs the same)
    num_full_layers: int
    num_linear_layers: int

    @classmethod
    def from_registry(cls, registry: LayerRegistry, kv_dtype: torch.dtype | None = None) -> "CacheLayout":
        # kv_dtype mirrors KVPool's override (e.g. an fp8 cache for a bf16 registry).
        def kv_bytes(layer) -> int:
            if kv_dtype is None:
                return layer.kv_bytes_per_token
            return sum(spec.numel * kv_dtype.itemsize for spec in layer.kv.values())

        full, linear = registry.full_layers(), registry.linear_layers()
        return cls(
            kv_bytes_per_token=sum(kv_bytes(l) for l in full),
            state_bytes_per_slot=sum(l.state_bytes_per_slot for l in linear),
            num_full_layers=len(full),
            num_linear_layers=len(linear),
        )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a budget is split. Every byte of the budget is in exactly one of the parts."""

    budget_bytes: int
    weight_bytes: int
    reserved_bytes: int
    layout: CacheLayout
    page_size: int
    num_pages: int
    num_slots: int  # slots requests can hold; the padding slot comes on top
    draft_tokens: int
    max_running: int | None  # the engine's batch cap the intermediates were sized for (None: every slot)
    intermediate_rows: int  # requests with intermediate states: min(num_slots, max_running), 0 if D = 0
    max_seq_len: int
    kv_dtype: str | None  # the KV pool's dtype override (None: each entry's registry dtype)
    main_state_bytes: int  # (num_slots + 1) * state_bytes_per_slot
    intermediate_bytes: int  # intermediate_rows * draft_tokens * state_bytes_per_slot
    num_snapshots: int  # the prefix cache's snapshot pool
    snapshot_bytes: int  # num_snapshots * state_bytes_per_slot
    kv_bytes: int  # num_pages * page_size * kv_bytes_per_token
    leftover_bytes: int
    ranks: int = 1  # tensor-parallel ranks: every number above is one rank's (one device's)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.layout.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        """Every byte of linear-layer state: main slots, intermediate states, snapshots."""
        return self.main_state_bytes + self.intermediate_bytes + self.snapshot_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pages_per_request(self) -> int:
        return _pages_per_request(self.max_seq_len, self.draft_tokens, self.page_size)

    @property
    def full_length_requests(self) -> int:
        """Requests of max_seq_len tokens the plan holds at once (slots and pages both)."""
        return min(self.num_slots, self.num_pages // self.pages_per_request)

    def table(self) -> str:
        s, D = self.layout.state_bytes_per_slot, self.draft_tokens
        rows = [
            ("weights", "", "", self.weight_bytes),
            ("reserved", "", "", self.reserved_bytes),
            ("state: main", f"{self.num_slots} + 1 padding slots", s, self.main_state_bytes),
            ("state: intermediate", f"{self.intermediate_rows} requests x {D} draft tokens", s,
             self.intermediate_bytes),
            ("state: snapshots", f"{self.num_snapshots} prefix-cache snapshots", s, self.snapshot_bytes),
            ("kv pages", f"{self.num_pages} pages x {self.page_size} tokens", self.page_bytes, self.kv_bytes),
            ("leftover", "", "", self.leftover_bytes),
            ("budget", "", "", self.budget_bytes),
        ]
        body = [(part, count, f"{unit:,}" if unit != "" else "", f"{nbytes:,}", f"{nbytes / GiB:.3f}")
                for part, count, unit, nbytes in rows]
        header = ("" if self.ranks == 1 else f"per rank of tensor parallel {self.ranks}: ") + (
                  f"{self.layout.num_linear_layers} linear layers ({s:,} B/slot), "
                  f"{self.layout.num_full_layers} full layers ({self.layout.kv_bytes_per_token:,} B/token); "
                  f"{self.kv_tokens:,} KV tokens, {self.full_length_requests} requests of {self.max_seq_len} tokens")
        return header + "\n" + tabulate(body, headers=("part", "count", "bytes/unit", "bytes", "GiB"),
                                        colalign=("left", "left", "right", "right", "right"))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}
        out["layout"] = dataclasses.asdict(self.layout)
        return out


def _pages_per_request(max_seq_len: int, draft_tokens: int, page_size: int) -> int:
    return pages_for(max_seq_len + draft_tokens, page_size)


def _state_bytes(num_slots: int, per_slot: int, draft_tokens: int, max_running: int | None) -> tuple[int, int, int]:
    """(main bytes, intermediate bytes, intermediate rows) for a slot count: the joint formula."""
    rows = 0 if draft_tokens == 0 else min(num_slots, num_slots if max_running is None else max_running)
    return (num_slots + 1) * per_slot, rows * draft_tokens * per_slot, rows


def _largest_slots(share: int, per_slot: int, draft_tokens: int, max_running: int | None) -> int:
    """Largest S with (S+1)*s + min(S,R)*D*s <= share (0 if even S = 0 does not fit; caller checks).

    While S <= R every slot brings its D intermediate rows: (S+1)*s + S*D*s = s + S*(1+D)*s.
    Past R the intermediate rows stop growing: (S+1)*s + R*D*s.
    """
    s, D = per_slot, draft_tokens
    if share < s:
        return 0
    below = (share - s) // ((1 + D) * s)
    if max_running is None or below < max_running:
        return below
    return (share - max_running * D * s) // s - 1  # >= R since S = R fits


def plan_memory(registry: LayerRegistry, *, budget_bytes: int, weight_bytes: int, max_seq_len: int,
                page_size: int = 16, num_slots: int | None = None, state_ratio: float | Fraction | None = None,
                max_running: int | None = None, draft_tokens: int = 0, min_requests: int = 1,
                reserved_bytes: int = 0, kv_dtype: torch.dtype | None = None,
                snapshot_share: float | Fraction = 0, ranks: int = 1) -> MemoryPlan:
    """Split `budget_bytes`; pass exactly one of `num_slots` or `state_ratio` (state bytes / KV bytes).

    ranks: for a rank of a tensor-parallel program (its registry, its weight shard, one device's
    budget): the plan and its errors say "per rank".

    max_running: the most requests a step can hold (the engine's batch cap); intermediate states
    are reserved for min(num_slots, max_running) of them. None means every slot can run.
    snapshot_share: the fraction of the budget left after weights and reserved bytes that goes to
    the prefix cache's snapshot pool (0: no prefix cache). The ratio then splits what remains.
    """
    if (num_slots is None) == (state_ratio is None):
        raise ValueError("plan_memory: pass exactly one of num_slots (explicit) or state_ratio (state / KV bytes)")
    for name, value, least in (("page_size", page_size, 1), ("max_seq_len", max_seq_len, 1),
                               ("draft_tokens", draft_tokens, 0), ("min_requests", min_requests, 1),
                               ("weight_bytes", weight_bytes, 0), ("reserved_bytes", reserved_bytes, 0)):
        if int(value) != value or value < least:
            raise ValueError(f"plan_memory: {name} must be an integer >= {least} (got {value!r})")
    if max_running is not None and max_running < min_requests:
        raise ValueError(f"plan_memory: max_running {max_running} is below min_requests {min_requests}")

    snapshot_share = Fraction(str(snapshot_share))  # as written: 0.1 is 1/10
    if not 0 <= snapshot_share < 1:
        raise ValueError(f"plan_memory: snapshot_share must be in [0, 1) (got {float(snapshot_share)!r})")

    where = "memory plan" if ranks == 1 else f"memory plan, per rank of tensor parallel {ranks}"
    per_rank = "" if ranks == 1 else " per rank"
    layout = CacheLayout.from_registry(registry, kv_dtype)
    s, t, D = layout.state_bytes_per_slot, layout.kv_bytes_per_token, draft_tokens
    page_bytes = page_size * t
    per_request_pages = _pages_per_request(max_seq_len, D, page_size)
    min_pages = min_requests * per_request_pages
    num_snapshots = int(max(budget_bytes - weight_bytes - reserved_bytes, 0) * snapshot_share) // s if s else 0
    snapshot_bytes = num_snapshots * s
    available = budget_bytes - weight_bytes - reserved_bytes - snapshot_bytes

    def minimum_total(slots: int) -> int:
        main, inter, _ = _state_bytes(slots, s, D, max_running)
        return weight_bytes + reserved_bytes + snapshot_bytes + main + inter + min_pages * page_bytes

    def too_small(slots: int, what: str) -> MemoryPlanError:
        need = minimum_total(slots)
        snapshots = f" + {num_snapshots} snapshots (snapshot_share {float(snapshot_share):g})" if snapshot_bytes else ""
        return MemoryPlanError(
            f"{where}: a budget of {budget_bytes:,} bytes cannot hold {what}: it needs {need:,} bytes "
            f"(weights {weight_bytes:,} + reserved {reserved_bytes:,}{snapshots} + state for {slots} slot(s) "
            f"+ {min_pages} pages of {page_bytes:,} bytes); {need - budget_bytes:,} bytes are missing{per_rank} "
            f"({format_bytes(need - budget_bytes)})",
            need - budget_bytes)

    if num_slots is not None:
        if num_slots < min_requests:
            raise ValueError(f"plan_memory: num_slots {num_slots} is below min_requests {min_requests}")
        if minimum_total(num_slots) > budget_bytes:
            raise too_small(num_slots, f"{num_slots} slots and {min_requests} request(s) of {max_seq_len} tokens")
        slots = num_slots
    else:
        if minimum_total(min_requests) > budget_bytes:
            raise too_small(min_requests, f"{min_requests} request(s) of {max_seq_len} tokens")
        # str() keeps the ratio the caller wrote (0.1 is 1/10, not the float's binary expansion).
        ratio = Fraction(str(state_ratio))
        if ratio <= 0:
            raise ValueError(f"plan_memory: state_ratio must be > 0 (got {state_ratio!r})")
        if s == 0:
            # No linear layers: slots cost nothing. One per running request, or per full-length request.
            fits = (available // page_bytes) // per_request_pages if page_bytes else min_requests
            slots = max_running or max(min_requests, fits)
        else:
            share = int(available * ratio / (1 + ratio))
            slots = _largest_slots(share, s, D, max_running)
            if slots < min_requests:
                main, inter, _ = _state_bytes(min_requests, s, D, max_running)
                raise MemoryPlanError(
                    f"{where}: state_ratio {state_ratio} gives the state pool {share:,} bytes, which holds "
                    f"{slots} slot(s); {min_requests} slot(s) need {main + inter:,} bytes "
                    f"({main + inter - share:,} missing). The budget itself suffices: use a ratio of at least "
                    f"{(main + inter) / (available - (main + inter)):.6g} or pass num_slots={min_requests}",
                    main + inter - share)

    main_bytes, inter_bytes, inter_rows = _state_bytes(slots, s, D, max_running)
    kv_share = available - main_bytes - inter_bytes
    if t == 0:
        # No full layers: pages cost nothing, but steps still map tokens to pages.
        num_pages = slots * per_request_pages
    else:
        num_pages = kv_share // page_bytes
    if num_pages < min_pages:
        # Only a ratio gets here (explicit slots were checked against the whole minimum above).
        missing = (min_pages - num_pages) * page_bytes - (kv_share - num_pages * page_bytes)
        raise MemoryPlanError(
            f"{where}: state_ratio {state_ratio} gives the state pool {main_bytes + inter_bytes:,} bytes "
            f"({slots} slots) and leaves the KV pool {kv_share:,} bytes, {num_pages} pages; "
            f"{min_requests} request(s) of {max_seq_len} tokens need {min_pages} pages "
            f"({missing:,} bytes missing). Use a smaller ratio or pass num_slots", missing)
    kv_bytes = num_pages * page_bytes
    if s == 0 and snapshot_share > 0:
        num_snapshots = num_pages  # they cost nothing; the cache holds at most one per page
    return MemoryPlan(
        budget_bytes=budget_bytes, weight_bytes=weight_bytes, reserved_bytes=reserved_bytes, layout=layout,
        page_size=page_size, num_pages=num_pages, num_slots=slots, draft_tokens=D, max_running=max_running,
        intermediate_rows=inter_rows, max_seq_len=max_seq_len,
        kv_dtype=None if kv_dtype is None else str(kv_dtype).removeprefix("torch."), main_state_bytes=main_bytes,
        intermediate_bytes=inter_bytes, num_snapshots=num_snapshots, snapshot_bytes=snapshot_bytes,
        kv_bytes=kv_bytes, leftover_bytes=kv_share - kv_bytes, ranks=ranks,
    )


def available_bytes(device: torch.device | str) -> int:
    """Free memory of a device now: the GPU's free bytes, or the host's available RAM (Linux's
    MemAvailable: free plus reclaimable caches; what an allocation can get without swapping)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_pools(registry: LayerRegistry, plan: MemoryPlan,
                device: torch.device | str = "cpu") -> tuple[KVPool, StatePool]:
    """Allocate the plan's pools (the state pool with the plan's intermediate states for D draft tokens)."""
    kv_dtype = None if plan.kv_dtype is None else dtype_from_name(plan.kv_dtype)
    return (KVPool(registry, plan.num_pages, plan.page_size, device, kv_dtype),
            StatePool(registry, plan.num_slots, device, draft_tokens=plan.draft_tokens,
                      verify_rows=plan.intermediate_rows))


def build_snapshot_pool(registry: LayerRegistry, plan: MemoryPlan, device: torch.device | str = "cpu") -> SnapshotPool:
    """Allocate the plan's snapshot pool (for runtime/cache/prefix_cache.py)."""
    return SnapshotPool(registry, plan.num_snapshots, device)


def pool_bytes(registry: LayerRegistry, *, num_slots: int, num_pages: int, page_size: int,
               num_snapshots: int = 0, draft_tokens: int = 0, verify_rows: int = 0) -> dict[str, int]:
    """What explicitly sized pools take: {"state", "intermediate", "snapshots", "kv"} in bytes (the
    pools' nbytes; "intermediate": the state pool's verify_rows x draft_tokens verify states)."""
    layout = CacheLayout.from_registry(registry)
    return {"state": (num_slots + 1) * layout.state_bytes_per_slot,
            "intermediate": verify_rows * draft_tokens * layout.state_bytes_per_slot,
            "snapshots": num_snapshots * layout.state_bytes_per_slot,
            "kv": num_pages * page_size * layout.kv_bytes_per_token}


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number above 1: '74.20 GiB', '3.1 MiB', '512 B'."""
    for unit, scale, digits in (("GiB", GiB, 2), ("MiB", 1 << 20, 1), ("KiB", 1 << 10, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n} B"


def describe_bytes(parts: dict[str, int]) -> str:
    """'weights 74.20 GiB + kv 3.00 GiB = 77.20 GiB' (parts in the order given, zeros left out)."""
    shown = [f"{name} {format_bytes(n)}" for name, n in parts.items() if n]
    return " + ".join(shown) + (f" = {format_bytes(sum(parts.values()))}" if len(shown) > 1 else "")


def check_fits(parts: dict[str, int], device: torch.device | str, ranks: int = 1, fix: str = "") -> None:
    """Raise MemoryPlanError naming the shortfall when `parts` (name -> bytes) exceed what `device`
    has free now. Only a CUDA device is checked (the CPU's memory is the host's, shared and paged)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    free = available_bytes(device)
    need = sum(parts.values())
    if need > free:
        where = "memory" if ranks == 1 else f"memory, per rank of tensor parallel {ranks}"
        short = need - free
        raise MemoryPlanError(f"{where}: {describe_bytes(parts)} do not fit the {format_bytes(free)} free on {device}: "
                              f"{format_bytes(short)} ({short:,} bytes) short{' per rank' if ranks > 1 else ''}"
                              f"{'; ' + fix if fix else ''}", short)
