"""Program load: torch.export.load of an artifact's programs against runtime/artifact/pt2_check.load_program.

    python benchmarks/host/program_load_bench.py --work /tmp/plb     # CPU or GPU machine; no weights needed

1. `hgc compile --no-weights` of a family's config (default: bench qwen3_next with head dim 64, the
   start-up bench's model, with its draft) for a cuda target: the programs are what a start-up
   loads; no weight is written, and no GPU is needed to compile or to load them.
2. In this process, alternately, `rounds` times: every program through `torch.export.load` of its
   bytes, through `load_program` (the same, checked, with the deserializer's repeated questions
   answered once per load), and the main program alone through `load_program` (what a run without
   drafts loads: `load_artifact(programs=("main",))`). The first round of each pays the imports the
   load triggers, so it is reported apart; the other rounds give the warm medians.
3. Both loads are compared: code, signature, ranges, every node's value.
4. The main program's JSON turned into torch's schema dataclasses (the part of a load
   `runtime/artifact/pt2_check._schema_plans` speeds up), `rounds` times each way, alternately: torch's
   converter under the load's other memos, and with the plans too; best of the rounds.

One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="folder for the config and the artifact (reused when present)")
    p.add_argument("--family", default="qwen3_next")
    p.add_argument("--size", default="bench")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    from hgc import main as hgc
    from compiler.splitops.artifact import PROGRAM_FILES
    from models.families import get_family
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.pt2_check import load_program
    from testkit.program_text import described  # what the test compares, compared the same way here

    work = Path(args.work)
    art = work / f"{args.family}-{args.size}-hd64-art"
    if not (art / "manifest.json").is_file():
        config = get_family(args.family).make_config(args.size)
        config["head_dim"] = 64
        (work / "config").mkdir(parents=True, exist_ok=True)
        (work / "config" / "config.json").write_text(json.dumps(config))
        assert hgc(["compile", str(work / "config"), "-o", str(art), "--no-weights", "--no-dumps", "--no-inductor",
                    "--target", "cuda", "--dtype", "bfloat16", "--force", "-q"]) == 0
    docs = read_artifact(art)
    files = {p: (docs.path / PROGRAM_FILES[p], docs.manifest["files"][PROGRAM_FILES[p]]) for p in docs.programs}
    seconds: dict[str, list[float]] = {"torch_export_load": [], "load_program": [], "main_program_alone": []}
    loaded = {}
    for _ in range(args.rounds):
        for way in seconds:
            t0 = time.perf_counter()
            if way == "torch_export_load":
                loaded[way] = {p: torch.export.load(io.BytesIO(path.read_bytes())) for p, (path, _) in files.items()}
            else:
                names = ("main",) if way == "main_program_alone" else files
                loaded[way] = {p: load_program(*files[p]) for p in names}
            seconds[way].append(time.perf_counter() - t0)
    same = all(described(loaded["torch_export_load"][p]) == described(loaded["load_program"][p]) for p in files)
    schema = _schema_conversion(files["main"][0], args.rounds)
    out = {"artifact": str(art), "programs": {p: len(ep.graph.nodes) for p, ep in loaded["load_program"].items()},
           "torch": torch.__version__, "same_programs": same,
           **{way: {"first_s": round(s[0], 3), "warm_median_s": round(statistics.median(s[1:]), 3) if len(s) > 1 else None}
              for way, s in seconds.items()}, "schema_conversion_best_s": schema}
    print(json.dumps(out))
    return 0 if same else 1


def _schema_conversion(path: Path, rounds: int) -> dict:
    """Step 4: seconds (best of `rounds`) to convert the program's model.json, both ways."""
    import contextlib
    import zipfile

    from torch._export.serde import schema, serialize

    from runtime.artifact import pt2_check

    with zipfile.ZipFile(path) as z:
        doc = json.loads(z.read(next(n for n in z.namelist() if n.endswith("models/model.json"))))
    best = {"torch_converter": float("inf"), "schema_plans": float("inf")}
    for _ in range(rounds):
        for way in best:
            with contextlib.ExitStack() as stack:
                stack.enter_context(pt2_check._deserializer_memos(plans=way == "schema_plans"))
                t0 = time.perf_counter()
                serialize._dict_to_dataclass(schema.ExportedProgram, doc)
                best[way] = min(best[way], time.perf_counter() - t0)
    return {way: round(s, 3) for way, s in best.items()}


if __name__ == "__main__":
    sys.exit(main())
