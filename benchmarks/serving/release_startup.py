"""Start each published release that fits one GPU, at full size with random weights, and run it.

What a user of a release meets first: compile, start-up (dummy weights made on the device, CUDA
graphs captured, start-up parity on every key), a few greedy tokens. Per config, each step in a
process of its own:

1. `hgc compile FOLDER --no-weights --no-inductor --target cuda --dtype bfloat16` (FOLDER holds
   the published config.json alone, from tests/configs) with a few buckets (--decode-buckets,
   --extend-buckets): start-up captures and checks each one, so fewer keys start sooner;
2. `hgc run ART --load-format dummy --json` on 4 prompts, --max-new-tokens each, greedy; with
   `--speculative-tokens 3` where the artifact has a draft (MTP) program.

Recorded: each command's exit status and seconds, the run's timing (hgc run --json) and the last
lines it printed on stderr (its start-up log, or the one-line error that refused it).

    python3 benchmarks/serving/release_startup.py --out $OUT --configs qwen3_5_35b_a3b,kimi_linear_48b_a3b
    python3 benchmarks/serving/release_startup.py --dry-run --out /tmp/rs --configs PATH.json   # CPU, float32

It does not time decoding against a baseline (benchmarks/serving/spec_bench.py --config and
benchmarks/serving/tp_bench.py do) nor run a release that needs several GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import device_facts, release_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = "3,5,7,11;20,21,22,23,24,25,26,27;100,101,102,103,104,105,106,107,108,109,110,111,112,113,114,115;9,9,9"
STDERR_LINES = 15


def hgc(args: list[str], timeout: float) -> dict:
    """One `hgc` command in its own process: exit status, seconds, stdout, stderr's last lines."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "hgc", *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, "", (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        err += f"\nrelease_startup: stopped after {timeout:.0f} s"
    return {"rc": rc, "seconds": round(time.perf_counter() - start, 2), "stdout": out,
            "stderr_tail": err.strip().splitlines()[-STDERR_LINES:]}


def one_release(name: str, args, work: Path) -> dict:
    """Steps 1 and 2 for one config; the record of each."""
    folder, art = work / f"config-{release_config(name).stem}", work / f"art-{release_config(name).stem}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(release_config(name), folder / "config.json")
    target = ["--target", "cpu", "--dtype", "float32"] if args.dry_run else ["--target", "cuda", "--dtype", "bfloat16"]
    rec = {"compile": hgc(["compile", str(folder), "-o", str(art), "--force", "--no-dumps", "--no-weights",
                           "--no-inductor", *target, "--decode-buckets", args.decode_buckets,
                           "--extend-buckets", args.extend_buckets], args.timeout_s)}
    rec["compile"].pop("stdout")
    if rec["compile"]["rc"] != 0:
        return rec
    programs = json.loads((art / "manifest.json").read_text())["programs"]
    spec = ["--speculative-tokens", "3"] if "draft" in programs else []
    run = hgc(["run", str(art), "--load-format", "dummy", "--json", "--prompt-ids", PROMPTS,
               "--max-new-tokens", str(args.new_tokens), *spec], args.timeout_s)
    stdout = run.pop("stdout")
    if run["rc"] == 0:
        result = json.loads(stdout)
        run["timing"] = result["timing"]
        run["output_lengths"] = [len(o["output_ids"]) for o in result["outputs"]]
    rec["run"] = {**run, "speculative_tokens": 3 if spec else 0}
    return rec


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for release_startup.json")
    p.add_argument("--work", default=None, help="folder for the config folders and artifacts (default: OUT/work)")
    p.add_argument("--configs", required=True, help="comma-separated names in tests/configs, or config.json paths")
    p.add_argument("--dry-run", action="store_true", help="CPU: float32, the cpu target")
    p.add_argument("--decode-buckets", default="1,8", help="hgc compile --decode-buckets")
    p.add_argument("--extend-buckets", default="256", help="hgc compile --extend-buckets")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--timeout-s", type=float, default=400, help="seconds each command may take")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or out / "work")
    rec = {"env": device_facts(args.dry_run), "config": vars(args), "releases": {}}
    for name in args.configs.split(","):
        print(f"=== {name} ===", flush=True)
        rec["releases"][name] = r = one_release(name, args, work)
        for step in ("compile", "run"):
            if step in r:
                print(f"{step}: rc {r[step]['rc']} in {r[step]['seconds']} s", flush=True)
                print("\n".join(f"  {line}" for line in r[step]["stderr_tail"]), flush=True)
        (out / "release_startup.json").write_text(json.dumps(rec, indent=1, default=str))
    return rec


if __name__ == "__main__":
    main()
