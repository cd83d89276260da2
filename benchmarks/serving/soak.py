"""The long soak of `hgc serve`: a mixed load for N minutes, then the numbers.

    python benchmarks/serving/soak.py ARTIFACT --minutes 10 --slots 4 --clients 10 --speculative-tokens 2

Starts `hgc serve ARTIFACT` (testkit/helpers.ServerProcess), runs testkit/soak.run_soak against it
(streamed and not, n > 1, stop strings, logprobs, structured output, chat, clients leaving
mid-stream, more clients than slots) and prints one JSON object: requests by kind, statuses,
pool counts before and after, the resident-memory curve, /health latency and the problems found
(none is the pass). Exit status 1 when a problem was found. tests/server/test_soak.py is the
short version CI runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.helpers import ServerProcess  # noqa: E402
from testkit.soak import run_soak  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--slots", type=int, default=4, help="hgc serve --slots")
    p.add_argument("--clients", type=int, default=10, help="clients sending at once (more than --slots: bursts)")
    p.add_argument("--speculative-tokens", type=int, default=2, help="hgc serve --speculative-tokens (0: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    args = p.parse_args()
    server = ServerProcess([args.artifact, "--served-model-name", "soak", "--slots", str(args.slots),
                            "--max-model-len", "512", "--speculative-tokens", str(args.speculative_tokens)])
    server.wait_ready(300)
    try:
        result = run_soak(server.url, server.proc.pid, args.minutes * 60, args.clients, "soak", args.seed,
                          sample_every=10.0)
    finally:
        code = server.stop()
    summary = {**result.summary(), "server_exit_status": code, "command": " ".join(sys.argv)}
    print(json.dumps(summary, indent=1))
    return 1 if summary["problems"] or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
