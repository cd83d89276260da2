"""Configs of the fused MoE's expert GEMMs: tiles per token bucket, read from JSON or chosen by default.

Kernel configs come from JSON files in `runtime/backends/kernels/moe_configs/` named
`E={E},I={I},device={device name, spaces as underscores}.json` (see the README there and
`benchmarks/kernels/tune_moe.py`, which writes them); without a file `default_config` decides. The backend
(runtime/backends/triton_moe.py) picks one per call with `pick_bucket`; the kernels
(runtime/backends/kernels/moe.py) launch with it. Plain Python: no triton here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from runtime.backends.kernels.launch_math import next_pow2

__all__ = ["CONFIG_DIR", "GemmConfig", "MoEConfig", "default_config", "FIXED_CONFIG", "FIXED_LOGITS_KERNEL",
           "fit_shared_memory", "device_name_of", "config_file_name", "load_config_table", "pick_bucket"]

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


_GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile of one expert GEMM. BLOCK_M == 1 selects the token-major GEMV kernels (no sorting)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        def pow2(v):
            return v >= 1 and v & (v - 1) == 0
        token = self.BLOCK_M == 1  # GEMV tiles: any power-of-two width; dot tiles: >= 16 each way
        ok = (pow2(self.BLOCK_N) and pow2(self.BLOCK_K) and self.BLOCK_K >= 16
              and (token or (pow2(self.BLOCK_M) and self.BLOCK_M >= 16 and self.BLOCK_N >= 16))
              and self.GROUP_M >= 1 and pow2(self.num_warps) and self.num_stages >= 1)
        if not ok:
            raise ValueError(f"bad MoE GEMM config {self}: blocks are powers of two, BLOCK_K >= 16; BLOCK_M is 1 "
                             "(token path) or >= 16 with BLOCK_N >= 16 (sorted path)")

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        unknown = set(d) - set(_GEMM_KEYS)
        if unknown:
            raise ValueError(f"unknown MoE config keys {sorted(unknown)} (known: {list(_GEMM_KEYS)})")
        return cls(**{k: int(v) for k, v in d.items()})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Configs of the two expert GEMMs for one token bucket. Both share BLOCK_M (the sort granule)."""

    gate_up: GemmConfig
    down: GemmConfig

    def __post_init__(self):
        if self.gate_up.BLOCK_M != self.down.BLOCK_M:
            raise ValueError(f"gate_up and down must share BLOCK_M (the sorted layout): {self}")

    @property
    def path(self) -> str:
        return "token" if self.gate_up.BLOCK_M == 1 else "sorted"

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        if "gate_up" in d or "down" in d:
            return cls(GemmConfig.from_dict(d["gate_up"]), GemmConfig.from_dict(d["down"]))
        both = GemmConfig.from_dict({k: v for k, v in d.items() if k in _GEMM_KEYS})  # one config for both
        return cls(both, both)

    def to_dict(self) -> dict:
        return {"gate_up": self.gate_up.to_dict(), "down": self.down.to_dict()}


# The sorted tiles for few pairs per expert (default_config's first bucket; FIXED_CONFIG below).
_FEW_PAIRS = MoEConfig(GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 128, 128, 1, 4, 4))


def default_config(T: int, E: int, I: int, D: int, top_k: int) -> MoEConfig:
    """The config used when no JSON file matches: untuned, fitted to the winners of one H200 tuning run
    (bf16, D 2048, I 512, E 16 top-4 and E 512 top-10; benchmarks/history/moe_notes.md).

    - Token path while few pairs share an expert: T <= 4, or T <= 8 when E >= 8 k. GEMV programs
      2 (T <= 2) or 4 columns wide that read the whole reduction in one step: their loads are not
      software-pipelined, so many small programs keep more bytes in flight than a few deep loops.
    - Otherwise sorted GEMMs, BLOCK_M from the mean rows per expert hit m = T k / min(E, T k):
      m <= 10 -> 16, m <= 24 -> 32, m <= 48 -> 64, else 128 (padding waste pays for fewer, fuller tiles).
    """
    if T <= 4 or (T <= 8 and E >= 8 * top_k):
        bn = 2 if T <= 2 else 4
        return MoEConfig(GemmConfig(1, bn, min(2048, next_pow2(D)), 1, 4, 1),
                         GemmConfig(1, bn, min(512, next_pow2(I)), 1, 2 if bn == 2 else 4, 1))
    m = T * top_k / max(1, min(E, T * top_k))
    if m <= 10:
        return _FEW_PAIRS
    if m <= 24:
        return MoEConfig(GemmConfig(32, 64, 128, 4, 4, 4), GemmConfig(32, 128, 64, 8, 4, 4))
    if m <= 48:
        return MoEConfig(GemmConfig(64, 64, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4))
    return MoEConfig(GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 128, 64, 8, 8, 4))


# Batch-invariant tiles (TritonMoEBackend(gemm_tiles="fixed")): one config for every token count, so a
# token's expert products are the same bits in a step of 1 token or of 512. The sorted path, not the
# token path: a pair's row reduces over BLOCK_K-wide steps in one order whatever other pairs share
# its tile, and the same BLOCK_K, warps and tensor-core tile serve every step. Its first bucket's
# tiles (the default for few pairs per expert), since decode and verify steps are where it runs most.
FIXED_CONFIG = _FEW_PAIRS
# ... and one router logits kernel: the GEMV reduces each token's row in one program whatever T is.
FIXED_LOGITS_KERNEL = "gemv"

# The sort ranks a block's pairs by a running count (sort_ranks="counted") up to this many experts,
# the shared expert's chunks among them: a [pairs, experts] one-hot wider than 64 bins would not fit
# the registers of a 256-pair step (kernels/moe.py `_place_pairs`).
COUNT_RANKS_MAX_EXPERTS = 64


def check_count_ranks(experts: int) -> None:
    """A one-line error where a sort of `experts` (routed and shared chunks) cannot count its ranks."""
    if experts > COUNT_RANKS_MAX_EXPERTS:
        raise ValueError(f"moe: {experts} experts are too many to count ranks (sort_ranks=counted takes at most "
                         f"{COUNT_RANKS_MAX_EXPERTS}, the shared expert's chunks among them)")


# Shared memory one block may take on Hopper: 232,448 bytes (227 KiB), less a little for Triton's own.
SHARED_MEMORY_BUDGET = 224 * 1024


def fit_shared_memory(config: MoEConfig, itemsize: int, budget: int = SHARED_MEMORY_BUDGET) -> MoEConfig:
    """The config with its sorted GEMMs' pipelines made to fit `budget` bytes of shared memory for
    operands of `itemsize` bytes: fewer stages first, then a narrower BLOCK_K.

    The default and tuned configs are sized for 2-byte operands; float32 operands take twice the
    bytes per tile (seen on an H200: 294,912 bytes asked for a float32 gate/up tile, 232,448 there).
    A buffer holds one A tile and the gate and up B tiles, (BLOCK_M + 2 BLOCK_N) BLOCK_K elements,
    and a pipeline of num_stages keeps num_stages - 1 of them (which gives that 294,912 for the
    128 x 128 x 64 float32 tile at 4 stages). Configs that fit are returned unchanged.
    """
    def fit(c: GemmConfig) -> GemmConfig:
        if c.BLOCK_M == 1:
            return c  # the token path keeps no pipelined tiles
        while max(1, c.num_stages - 1) * (c.BLOCK_M + 2 * c.BLOCK_N) * c.BLOCK_K * itemsize > budget:
            if c.num_stages > 2:
                c = dataclasses.replace(c, num_stages=c.num_stages - 1)
            elif c.BLOCK_K > 16:
                c = dataclasses.replace(c, BLOCK_K=c.BLOCK_K // 2)
            else:
                break
        return c
    return MoEConfig(fit(config.gate_up), fit(config.down))


def device_name_of(device: torch.device) -> str:
    """'NVIDIA_H100_80GB_HBM3' for CUDA devices, 'cpu' for the CPU (Triton interpreter)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return device.type


def config_file_name(E: int, I: int, device_name: str) -> str:
    return f"E={E},I={I},device={device_name}.json"


def load_config_table(path: Path) -> dict[int, MoEConfig]:
    """{bucket token count: config} from one JSON file (see moe_configs/README.md for the format)."""
    try:
        data = json.loads(Path(path).read_text())
        buckets = data["buckets"]
        table = {int(k): MoEConfig.from_dict(v) for k, v in buckets.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"MoE config file {path}: {exc}") from exc
    if not table:
        raise ValueError(f"MoE config file {path}: no buckets")
    return table


def pick_bucket(table: dict[int, MoEConfig], T: int) -> MoEConfig:
    """The smallest bucket >= T, or the largest bucket when T is past all of them."""
    larger = [b for b in table if b >= T]
    return table[min(larger) if larger else max(table)]
