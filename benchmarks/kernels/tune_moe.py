"""Tune the fused MoE's kernel configs per token bucket and write them as JSON for this device.

    python3 benchmarks/kernels/tune_moe.py --out $OUT                 # both bench layers, bf16
    python3 benchmarks/kernels/tune_moe.py --out $OUT --shapes e16 --budget-s 240
    python3 benchmarks/kernels/tune_moe.py --dry-run --out /tmp/moe   # interpreter, tiny dims, 2 buckets

Writes `runtime/backends/kernels/moe_configs/E={E},I={I},device={device}.json` (read by TritonMoEBackend)
and a copy as OUT/moe_configs/E{E}_I{I}_{device}.json (the GPU machine keeps nothing, and its file
transfer refuses names with '=' or ','). Back on the CPU machine, put the copies in place with

    python3 benchmarks/kernels/tune_moe.py --install OUTDIR/moe_configs/*.json

A dry run writes only under OUT.

The layers are gpu_moe.py's (moe_layers.py), shared expert included (its chunks are extra experts every token
takes, so they are part of the work being tuned); --no-shared tunes the routed experts alone.

Per bucket T (1, 2, 4, ..., 4096), with one fixed random routing:
1. Token path (T <= 8): each GEMV stage timed alone over a few (BLOCK_N, BLOCK_K, warps, stages).
2. Sorted path: for each BLOCK_M that suits T*k / (experts hit), sort once, then time each GEMM
   stage alone over a short list of tiles; keep the best per stage (they share BLOCK_M only).
3. The whole op, captured in a CUDA graph, for each path's winner and for `default_config`;
   the fastest is written (the default unless the fastest beats it by more than MIN_GAIN), with
   its time and the default's time beside it.
Stage times are do_bench medians with L2 flushed before every run. A config that fails to compile
or launch (too much shared memory) is skipped and counted. When the time budget runs out, the
buckets left get `default_config`, marked as such in the file.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_layers

import torch  # noqa: E402
import triton  # noqa: E402

from moe_layers import DRY_SHAPES, ROUTING, SHAPES, Bench, make_layer  # noqa: E402
from runtime.backends.kernels.moe_config import (  # noqa: E402
    CONFIG_DIR, GemmConfig, MoEConfig, config_file_name, default_config, device_name_of, load_config_table,
)
from runtime.backends.kernels.moe import (  # noqa: E402
    down_sorted, down_token, fused_moe, gate_up_sorted, gate_up_token, route, shared_chunks, sort_tokens,
)

BUCKETS_GPU = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
BUCKETS_DRY = [1, 8]
TOKEN_PATH_MAX_T = 8

# (BLOCK_N, BLOCK_K, num_warps) of the GEMV stages. Their loads are not software-pipelined, so the
# good tiles are narrow and deep (the whole reduction in one or two steps) with many programs.
# BLOCK_K is capped at the reduction length (D for gate_up, I for down) when the list is used.
TOKEN_GATE_UP_TILES = [(2, 2048, 4), (1, 2048, 4), (2, 2048, 8), (4, 2048, 8), (4, 1024, 4), (8, 1024, 8),
                       (16, 512, 8)]
TOKEN_DOWN_TILES = [(2, 512, 2), (1, 512, 2), (2, 512, 4), (4, 512, 4), (8, 512, 4), (4, 1024, 8), (8, 256, 4),
                    (16, 256, 4), (16, 512, 8), (32, 256, 8)]
# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per BLOCK_M for the sorted GEMMs. gate_up keeps
# two accumulators (gate and up), so its N tiles stay narrower than down's.
GATE_UP_TILES = {
    16: [(32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (64, 64, 1, 4, 5), (128, 64, 1, 4, 4), (32, 256, 1, 4, 3),
         (64, 256, 1, 4, 3), (128, 128, 1, 8, 3)],
    32: [(64, 128, 4, 4, 4), (64, 64, 8, 4, 4), (128, 64, 4, 4, 4), (32, 128, 1, 4, 4), (128, 128, 8, 8, 3)],
    64: [(64, 64, 8, 4, 4), (128, 64, 8, 4, 4), (64, 128, 8, 4, 3), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3)],
    128: [(64, 64, 8, 4, 4), (128, 64, 8, 8, 4), (128, 64, 8, 8, 3), (64, 128, 8, 8, 3)],
}
DOWN_TILES = {
    16: [(64, 128, 1, 4, 4), (128, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 64, 1, 4, 4), (256, 64, 1, 8, 4),
         (32, 128, 1, 4, 4)],
    32: [(64, 128, 4, 4, 4), (128, 128, 4, 4, 3), (128, 64, 8, 4, 4), (256, 64, 8, 8, 3), (64, 64, 1, 4, 4)],
    64: [(64, 64, 8, 4, 4), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (64, 128, 8, 4, 3)],
    128: [(128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (64, 64, 8, 4, 4)],
}
DRY_LIMIT = 2  # tiles per stage in a dry run: the interpreter is slow and its timings mean nothing


def block_m_candidates(T: int, top_k: int, E: int) -> list[int]:
    """BLOCK_M values worth trying: near the mean rows per expert hit, m = T*k / min(E, T*k)."""
    m = T * top_k / max(1, min(E, T * top_k))
    # Seen on an H200: BLOCK_M up to ~3 m still wins (fewer, fuller tiles beat less padding).
    picks = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 4 * m) and bm >= min(64, m / 4)]
    return picks or [16]


def _token_tiles(tiles, depth: int) -> list:
    """GEMV configs with BLOCK_K capped at the next power of two of the reduction length, deduplicated."""
    cap = 1 << max(4, (depth - 1).bit_length())
    out = []
    for bn, bk, w in tiles:
        cfg = GemmConfig(1, bn, min(bk, cap), 1, w, 1)
        if cfg not in out:
            out.append(cfg)
    return out


def _best(bench: Bench, label: str, candidates, run, log: list) -> tuple:
    """Time run(cfg) for each candidate; return (best cfg, best ms). Failures are logged and skipped."""
    best = (None, float("inf"))
    for cfg in candidates:
        try:
            ms = bench.time_ms(lambda: run(cfg), rep_ms=25)
        except Exception as exc:  # a tile that does not fit (shared memory, registers) is skipped
            log.append({"stage": label, "config": cfg.to_dict(), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        if ms < best[1]:
            best = (cfg, ms)
    if best[0] is None:
        raise RuntimeError(f"tune: no {label} config ran (see the failures in the log)")
    return best


def tune_bucket(bench: Bench, layer, T: int, E: int, top_k: int, log: list) -> dict:
    router, _, w13, w2, sw13, sw2, gate = layer
    D, I, dev = bench.D, bench.I, bench.device
    limit = DRY_LIMIT if bench.dry else None
    routing = (top_k, ROUTING["scoring"], ROUTING["renormalize"], ROUTING["routed_scale"],
               ROUTING["num_groups"], ROUTING["topk_groups"])
    # The shared expert's chunks are experts E.. that every token takes: tuned with them in.
    n_shared = shared_chunks(bench.S, I)
    experts, slots = E + n_shared, top_k + n_shared
    x = torch.randn(T, D, device=dev).to(bench.dtype)
    ids, weights = route(x, router, None, *routing, n_shared=n_shared, shared_gate=gate)
    out = torch.empty(T, D, device=dev, dtype=bench.dtype)
    finalists: dict[str, MoEConfig] = {}
    stages = {}

    if T <= TOKEN_PATH_MAX_T:
        gu_tiles = _token_tiles(TOKEN_GATE_UP_TILES, D)[:limit]
        dn_tiles = _token_tiles(TOKEN_DOWN_TILES, I)[:limit]
        h = gate_up_token(x, w13, ids, gu_tiles[0], shared_w13=sw13)
        gu, gu_ms = _best(bench, "gate_up_token", gu_tiles,
                          lambda c: gate_up_token(x, w13, ids, c, h=h, shared_w13=sw13), log)
        dn, dn_ms = _best(bench, "down_token", dn_tiles,
                          lambda c: down_token(h, w2, ids, weights, out, c, shared_w2=sw2), log)
        finalists["token"] = MoEConfig(gu, dn)
        stages["token"] = {"gate_up_us": gu_ms * 1e3, "down_us": dn_ms * 1e3}

    for bm in block_m_candidates(T, top_k, E):
        sort = sort_tokens(ids, experts, bm)
        R = sort[0].shape[0]
        h = torch.empty(R, I, device=dev, dtype=bench.dtype)
        y = torch.empty(T * slots, D, device=dev, dtype=bench.dtype)
        gu_tiles = [GemmConfig(bm, *t) for t in GATE_UP_TILES[bm]][:limit]
        dn_tiles = [GemmConfig(bm, *t) for t in DOWN_TILES[bm]][:limit]
        gu, gu_ms = _best(bench, f"gate_up_sorted_bm{bm}", gu_tiles,
                          lambda c: gate_up_sorted(x, w13, *sort, slots, c, h=h, shared_w13=sw13), log)
        dn, dn_ms = _best(bench, f"down_sorted_bm{bm}", dn_tiles,
                          lambda c: down_sorted(h, w2, weights, *sort, c, y=y, shared_w2=sw2), log)
        finalists[f"sorted_bm{bm}"] = MoEConfig(gu, dn)
        stages[f"sorted_bm{bm}"] = {"gate_up_us": gu_ms * 1e3, "down_us": dn_ms * 1e3}

    finalists["default"] = default_config(T, E, I, D, top_k)
    whole = {}
    for name, cfg in finalists.items():
        try:
            ms, _ = bench.graph_ms(lambda: fused_moe(x, *layer, out, *routing, cfg), rep_ms=50)
            whole[name] = ms * 1e3
        except Exception as exc:
            log.append({"stage": f"whole_{name}", "config": cfg.to_dict(), "error": f"{type(exc).__name__}: {exc}"[:300]})
    best = pick_winner(whole)
    entry = finalists[best].to_dict()
    entry.update({"us": round(whole[best], 2), "default_us": round(whole.get("default", float("nan")), 2),
                  "winner": best, "whole_us": {k: round(v, 2) for k, v in whole.items()}, "stages_us": stages})
    return entry


# A tuned config replaces the default only when the whole op is faster by more than this: closer
# times are within timing noise (an H200 run once picked 34.70 us over the default's 34.72 us).
MIN_GAIN = 0.02


def pick_winner(whole_us: dict) -> str:
    """The fastest finalist, or "default" unless that one beats the default by more than MIN_GAIN."""
    best = min(whole_us, key=whole_us.get)
    if "default" in whole_us and whole_us[best] > whole_us["default"] * (1 - MIN_GAIN):
        return "default"
    return best


def tune_shape(bench: Bench, E: int, top_k: int, buckets: list[int], deadline: float, log: list) -> dict:
    layer = make_layer(bench, E, seed=1234 + E)
    table = {}
    for T in buckets:
        if time.time() > deadline:
            cfg = default_config(T, E, bench.I, bench.D, top_k).to_dict()
            cfg["source"] = "default (tuning budget ran out)"
            table[str(T)] = cfg
            continue
        t0 = time.time()
        entry = tune_bucket(bench, layer, T, E, top_k, log)
        entry["source"] = "tuned"
        table[str(T)] = entry
        print(f"[tune E={E} T={T}] {entry['winner']}: {entry['us']:.1f}us (default {entry['default_us']:.1f}us) "
              f"[{time.time() - t0:.1f}s]", flush=True)
        if bench.dry:
            continue
        torch.cuda.empty_cache()
    return table


def tune_all(base: Bench, shapes: dict, config_dir: Path, out_dir: Path, budget_s: float,
             buckets: list[int] | None = None) -> dict:
    """Tune every shape, write one JSON per shape into config_dir and out_dir/moe_configs; return a summary."""
    buckets = buckets or (BUCKETS_DRY if base.dry else BUCKETS_GPU)
    device = device_name_of(base.device)
    deadline = time.time() + budget_s
    summary = {}
    for n, (name, shape) in enumerate(shapes.items()):
        # Each shape may use the budget left, shared evenly with the shapes still to come.
        shape_deadline = time.time() + (deadline - time.time()) / (len(shapes) - n)
        log: list = []
        bench = base.for_shape(shape)
        table = tune_shape(bench, shape["E"], shape["top_k"], buckets, shape_deadline, log)
        doc = {
            "meta": {"E": shape["E"], "I": bench.I, "D": bench.D, "S": bench.S, "top_k": shape["top_k"],
                     "dtype": str(bench.dtype),
                     "device": device, "torch": torch.__version__, "triton": triton.__version__,
                     "date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join(sys.argv), "interpreter": bench.dry, "failures": log},
            "buckets": table,
        }
        fname = config_file_name(shape["E"], bench.I, device)
        doc["meta"]["file_name"] = fname
        text = json.dumps(doc, indent=1) + "\n"
        Path(config_dir).mkdir(parents=True, exist_ok=True)
        (Path(config_dir) / fname).write_text(text)
        # The copy that leaves the GPU machine gets a plain name: its file transfer refuses '=' and ','.
        # `tune_moe.py --install` puts it back under meta.file_name.
        copy = Path(out_dir) / "moe_configs" / safe_name(fname)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(text)
        written = [str(Path(config_dir) / fname), str(copy)]
        print(f"tune: wrote {' and '.join(dict.fromkeys(written))} ({len(log)} configs failed)", flush=True)
        summary[name] = {"files": written, "failures": len(log),
                         "buckets": {t: {"winner": v.get("winner", v.get("source")), "us": v.get("us"),
                                         "default_us": v.get("default_us")} for t, v in table.items()}}
    return summary


def safe_name(file_name: str) -> str:
    """'E=16,I=512,device=NVIDIA_H200.json' -> 'E16_I512_NVIDIA_H200.json' (letters, digits, _ . - only)."""
    stem = file_name[:-len(".json")].replace("device=", "").replace("=", "").replace(",", "_")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) + ".json"


def reselect(paths: list[Path]) -> None:
    """Pick each bucket's winner again from the whole-op times the file records (after a change of
    `pick_winner`), putting back `default_config` where the default now wins. Nothing is re-timed."""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        meta = doc["meta"]
        for t, entry in doc["buckets"].items():
            whole = entry.get("whole_us")
            winner = pick_winner(whole) if whole else entry.get("winner")
            if winner == entry.get("winner"):
                continue
            if winner != "default":
                raise SystemExit(f"tune_moe --reselect: {path} bucket {t}: {winner} wins but its config is not recorded")
            cfg = default_config(int(t), meta["E"], meta["I"], meta["D"], meta["top_k"]).to_dict()
            entry.update(cfg, winner="default", us=whole["default"])
            print(f"{path} bucket {t}: the default instead of {list(whole)} times {whole}")
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        load_config_table(Path(path))


def install(paths: list[Path], config_dir: Path) -> None:
    """Copy tuned files (from OUT/moe_configs/) into config_dir under their real names (meta.file_name)."""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        name = doc.get("meta", {}).get("file_name")
        if not name:
            raise SystemExit(f"tune_moe --install: {path} has no meta.file_name (not written by tune_moe?)")
        load_config_table(Path(path))  # refuse a file the backend could not read
        target = Path(config_dir) / name
        target.write_text(Path(path).read_text())
        print(f"installed {path} -> {target}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for tune_moe.json and the copies of the config files")
    parser.add_argument("--install", nargs="+", type=Path, default=None, metavar="FILE",
                        help="copy tuned files from OUT/moe_configs/ into the config folder under their real names")
    parser.add_argument("--reselect", nargs="+", type=Path, default=None, metavar="FILE",
                        help="pick each bucket's winner again from the times a config file records (no GPU)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny dims")
    parser.add_argument("--shapes", default=None, help="comma list of layers (default: all)")
    parser.add_argument("--buckets", default=None, help="comma list of token buckets")
    parser.add_argument("--budget-s", type=float, default=480.0, help="time budget for all shapes")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="where the backend reads configs (default: the repo's; a dry run: OUT/moe_configs)")
    parser.add_argument("--no-shared", action="store_true", help="tune layers without the shared expert")
    args = parser.parse_args(argv)
    if args.reselect:
        reselect(args.reselect)
        return 0
    if args.install:
        install(args.install, args.config_dir or CONFIG_DIR)
        return 0
    if args.out is None:
        parser.error("--out is required (unless --install)")
    bench = Bench(args.dry_run, shared=not args.no_shared)
    shapes = DRY_SHAPES if bench.dry else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    config_dir = args.config_dir or (args.out / "moe_configs" if bench.dry else CONFIG_DIR)
    t0 = time.time()
    summary = tune_all(bench, shapes, config_dir, args.out, args.budget_s, buckets)
    (args.out).mkdir(parents=True, exist_ok=True)
    (args.out / "tune_moe.json").write_text(json.dumps(summary, indent=1))
    print(f"tune: done in {time.time() - t0:.0f}s")
    for name, s in summary.items():
        for t, b in s["buckets"].items():
            us = "-" if b["us"] is None else f"{b['us']:.1f}"
            dus = "-" if b["default_us"] is None else f"{b['default_us']:.1f}"
            print(f"{name:<6}T={t:>5} {str(b['winner']):<16} {us:>9} us  (default {dus} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
