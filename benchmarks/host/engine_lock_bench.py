"""How long a caller waits for the engine loop's lock while steps hold the interpreter.

    python benchmarks/host/engine_lock_bench.py [--step-ms 10] [--calls 30]

A CPU forward holds the GIL for the length of its step; a server thread that wants to submit or
cancel meanwhile must get the EngineLoop's lock between two steps. This runs the toy engine of
the tests with steps that busy-wait --step-ms, calls `stats()` from this thread every few
milliseconds, and prints the longest and the mean wait, in milliseconds and in steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.engine.engine import SamplingParams  # noqa: E402
from runtime.engine.loop import EngineLoop  # noqa: E402
from testkit.engine_toy import build_model, make_engine, prompts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args(argv)
    engine = make_engine(build_model("toy"), num_slots=2, num_pages=256, page_size=4)
    unpaced = engine.step

    def busy_step():
        start = time.perf_counter()
        while time.perf_counter() - start < args.step_ms / 1e3:
            pass
        return unpaced()

    engine.step = busy_step
    waits = []
    with EngineLoop(engine) as loop:
        handle = loop.submit(prompts(1, [10], 96, seed=8)[0], SamplingParams(max_new_tokens=1000))
        for _ in range(args.calls):
            time.sleep(0.005)
            t0 = time.perf_counter()
            loop.stats()
            waits.append((time.perf_counter() - t0) * 1e3)
        loop.cancel(handle.request_id)
    print(f"step {args.step_ms:.1f} ms, {args.calls} stats() calls: longest wait {max(waits):.1f} ms "
          f"({max(waits) / args.step_ms:.1f} steps), mean {statistics.mean(waits):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
