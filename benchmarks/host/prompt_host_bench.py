"""Where a short prompt's time to first token goes on an idle engine: the step's replay against the host around it.

    python benchmarks/host/prompt_host_bench.py --out $OUT --artifact ART   # GPU machine, the serving engine
    python benchmarks/host/prompt_host_bench.py --dry-run --out /tmp/phb     # CPU, tiny qwen3_next: the script's own test

The engine is the one `hgc serve` builds (runtime/assembly.engine_for_artifact: CUDA graphs captured and
parity-checked, prefix cache off, as multiturn_bench.py's short prompt runs). Per --tokens T:

1. ttft: --iters fresh prompts of T tokens one after another, each to its first token: the engine's
   first_token_s (arrival to the token on the host), median and min;
2. run: in the same prompts, the runner's `run_outputs` (its host work: the static buffers' fill, the
   backends' replay state, then the replay or the pieces; wall, the device synchronised at its end), so
   TTFT minus it is the engine's host work around the step (scheduling, layout, sampling, the token's
   copy back); step_account.py times the replay alone;
3. profile: cProfile of --profile-iters more prompts, nothing synchronised but what the engine does
   (bench_common.host_profile), the top functions by own and cumulative time in ms per prompt;
4. timeline (CUDA): 5 more under the profiler (bench_common.request_timeline): the host's time before
   the first kernel, the kernels, the device's idle gaps.

Writes OUT/prompt_host_bench.json and prints one line per T.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import compiled_artifact, host_profile, request_timeline, synchronizer  # noqa: E402


class TimedRun:
    """The runner's run_outputs with its wall time (device synchronised at its end) accumulated."""

    def __init__(self, runner, sync):
        self.runner, self.real, self.sync, self.seconds = runner, runner.run_outputs, sync, 0.0
        runner.run_outputs = self

    def restore(self):
        self.runner.run_outputs = self.real

    def __call__(self, *inputs, **kw):
        t0 = time.perf_counter()
        out = self.real(*inputs, **kw)
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--artifact", default=None, help="an artifact folder (default: compile a bench qwen3_next in --work)")
    p.add_argument("--work", default="/tmp/prompt_host_work")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny qwen3_next, graphs off")
    p.add_argument("--tokens", default="16,32,128", help="prompt lengths, comma-separated")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile-iters", type=int, default=20)
    args = p.parse_args(argv)
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.engine.sampling import SamplingParams

    device = "cpu" if args.dry_run else "cuda"
    args.family, args.size, args.compiled_pieces, args.route = "qwen3_next", "tiny" if args.dry_run else "bench", False, []
    args.dtype, args.config, args.batch_invariant = None, None, False
    art = load_artifact(compiled_artifact(args), device=device)
    vocab = int(art.manifest["model"]["vocab_size"])
    lengths = [int(t) for t in args.tokens.split(",")]
    max_len = 2 * max(lengths) + 8
    options = EngineOptions(slots=8, max_model_len=max_len, prefix_cache=False)
    engine = engine_for_artifact(art, options, max_len, device=device)
    sync = synchronizer(torch.device(device))
    g = torch.Generator().manual_seed(0)
    rec = {"artifact": str(args.artifact or ""), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "lengths": {}}

    for T in lengths:
        def prompt():
            ids = torch.randint(2, vocab, (T,), generator=g).tolist()
            rid = engine.add_request(ids, SamplingParams(max_new_tokens=1))
            while rid in engine._live:
                engine.step()
            return engine.pop_result(rid)

        for _ in range(3):
            prompt()
        ttft, fwd = [], []
        forward = TimedRun(engine.runner, sync)
        for _ in range(args.iters):
            sync()
            f0 = forward.seconds
            ttft.append(prompt().first_token_s * 1e3)
            fwd.append((forward.seconds - f0) * 1e3)
        forward.restore()
        host = [a - b for a, b in zip(ttft, fwd)]
        row = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_min": min(ttft),
               "run_ms_median": statistics.median(fwd), "host_ms_median": statistics.median(host),
               "profile": host_profile(prompt, iters=args.profile_iters, top=30, sync=sync),
               "timeline": request_timeline(lambda: None, prompt, torch.device(device))}
        rec["lengths"][str(T)] = row
        print(f"T={T}: TTFT median {row['ttft_ms_median']:.3f} ms (min {row['ttft_ms_min']:.3f}); "
              f"{row['run_ms_median']:.3f} ms in run_outputs; {row['host_ms_median']:.3f} ms around it", flush=True)
        for r in row["profile"]["top_cum"][:25]:
            print(f"    cum {r['cum_ms']:8.3f}  own {r['own_ms']:8.3f}  x{r['calls_per_call']:<5g} {r['function']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_host_bench.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
