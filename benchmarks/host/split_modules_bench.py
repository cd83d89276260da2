"""What a start-up pays to build each mode's split modules: the split (apply_split_plan) and the install
of compiled glue (runtime/artifact/compiled_glue.py), per mode, on a full-size program.

    python benchmarks/host/split_modules_bench.py --work /tmp/smb     # CPU or GPU machine; no weights needed

1. `hgc compile --no-weights --target cuda` of a published config (default: Qwen3-Next-80B-A3B, 48
   layers, from tests/configs): its program is what a tensor-parallel start-up splits; no GPU and no
   weight is needed to compile or to split it.
2. Per mode, `rounds` times: `apply_split_plan` of the program alone, then the install of its glue
   into that split. The glue's pieces are the traced segments themselves (testkit/traced_glue.py):
   the install's work is the same whatever a piece runs.

A start-up that runs compiled pieces builds two modules per mode, the compiled one it captures and
the traced one the start-up check compares with. It now splits once and installs on copies of the
pieces that get compiled glue (runtime/artifact/loader.py `module_for`); it used to split once per module,
so `split_s` is what each mode saves and `install_s` (the copies included) what it pays on top.
One JSON line on stdout: medians over the rounds.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="folder for the config and the artifact (reused when present)")
    p.add_argument("--config", default=str(ROOT / "tests" / "configs" / "qwen3_next_80b_a3b.json"),
                   help="a published config.json (default: Qwen3-Next-80B-A3B)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from hgc import main as hgc
    from compiler.splitops.artifact import apply_split_plan
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs
    from testkit.traced_glue import traced_glue

    work = Path(args.work)
    config, art = work / "config", work / "art"
    if not (art / "manifest.json").is_file():
        config.mkdir(parents=True, exist_ok=True)
        (config / "config.json").write_text(Path(args.config).read_text())
        assert hgc(["compile", str(config), "-o", str(art), "--target", "cuda", "--dtype", "bfloat16", "--no-weights",
                    "--no-inductor", "--no-dumps", "--force"]) == 0
    docs = read_artifact(art, verify_hashes=False)
    gm = load_programs(docs)["main"].graph_module
    glue = traced_glue(gm, "main")
    report = {"config": args.config, "nodes": len(gm.graph.nodes), "modes": {}}
    for mode, plan in docs.split_plans["main"].items():
        split_s, install_s = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            split = apply_split_plan(gm, plan)
            split_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            glue.install(split, plan)
            install_s.append(time.perf_counter() - start)
        report["modes"][mode.value] = {"pieces": len(plan.pieces), "split_s": round(statistics.median(split_s), 3),
                                       "install_s": round(statistics.median(install_s), 3)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
