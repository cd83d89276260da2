"""Where the host time of a replayed decode step goes: the step against its graph's replay alone.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/replay_host_probe.py --out $OUT

A full-graph decode step (`GraphRunner.run`) is one graph replay plus the host work before it:
the copy of the step into the static buffers (`_fill`) and each backend's `init_replay_state`
(FlashInfer's plan, the slot ids of the linear and MoE backends). The step is timed between CUDA
events after a synchronize, as benchmarks/serving/startup_bench.py times it, so host work before the
replay leaves the device idle and is part of the number. This probe times, per batch, the whole
step, the replay alone (`graph.replay()` on the same filled buffers) and the host part, and
names the functions that take the host time (cProfile, by own time and by cumulative time).
Bench-size qwen3_next (head dim 64), bf16, the portable artifact (the host path of a replay is
the same with compiled pieces). Writes OUT/replay_host_probe.json. `--route` is passed to
`hgc compile` as it is (repeatable): e.g. `--route "gqa_attention=flashinfer[decode_impl=flashinfer]"`
times FlashInfer's planned decode instead of the default plan-free Triton one; run the probe twice, with and without it, to compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import decode_batch, host_profile, time_ms, write_checkpoint_hd64  # noqa: E402

PAGE = 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="bench")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--route", action="append", default=[], help="passed to hgc compile --route (repeatable)")
    args = p.parse_args(argv)
    from hgc import main as hgc
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.artifact.loader import load_artifact

    dev = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "size": args.size, "routes": args.route, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        write_checkpoint_hd64(args.size, Path(tmp, "c"))
        routes = [arg for route in args.route for arg in ("--route", route)]
        assert hgc(["compile", f"{tmp}/c", "-o", f"{tmp}/a", "--target", "cuda", "--dtype", "bfloat16", "--no-dumps",
                    "--no-inductor", *routes]) == 0
        art = load_artifact(f"{tmp}/a", dev)
        max_len = 256
        kv, st = make_pools(art.registry, max_len, max(batches), page_size=PAGE, device=dev, kv_dtype=torch.bfloat16)
        ops = art.backends(kv, st).op_table("main")
        runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=tuple(batches), extend_buckets=(256,),
                             max_pages_per_seq=max_len // PAGE, extend_max_seqs=1)
        t0 = time.perf_counter()
        runner.start(int(art.manifest["model"]["vocab_size"]), log=lambda line: print(" ", line, flush=True))
        doc["start_s"] = time.perf_counter() - t0
        vocab = int(art.manifest["model"]["vocab_size"])
        g = torch.Generator().manual_seed(0)
        for B in batches:
            with decode_batch(runner, st, B, vocab, g) as items:
                step, key = runner.build(items)
                graph, _ = runner._full_graphs[key]  # (graph, its static outputs)
                cell = {"key": str(key)}
                cell["step_ms"] = time_ms(lambda: runner.run(step, key), dev, args.iters)
                cell["replay_ms"] = time_ms(graph.replay, dev, args.iters)
                host = []
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    runner.run(step, key)
                    host.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
                cell["host_ms"] = sorted(host)[len(host) // 2]
                cell.update(host_profile(lambda: runner.run(step, key), args.iters, top=25, sync=torch.cuda.synchronize))
                doc["batches"][str(B)] = cell
                print(f"B={B}: step {cell['step_ms']:.3f} ms, replay alone {cell['replay_ms']:.3f} ms, host "
                      f"{cell['host_ms']:.3f} ms ({key})", flush=True)
                for r in cell["top_cum"][:20]:
                    print(f"    cum {r['cum_ms']:8.4f}  own {r['own_ms']:8.4f}  x{r['calls_per_call']:<5g} {r['function']}")
    (out / "replay_host_probe.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
