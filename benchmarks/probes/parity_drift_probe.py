"""Where the start-up parity check's unpadded run parts from its padded one, op by op, at depth.

The check (runtime/graphs/startup_parity.py `_check_key`, runtime/graphs/parity.py TeacherForcing) hands each op
of the unpadded run the padded run's inputs and measures how far the glue had computed them.
Values the glue carries past the ops (the residual stream, a dense MLP) are not handed over, so
their rounding differences travel from layer to layer. This probe starts a GraphRunner with one
decode bucket B (its check: B - 1 requests padded to B) and prints, from the check's own record
(`GraphRunner.parity.errors`, kept whether the key passes or is refused), per op, the glue's and
the op's relative error: rounding drift grows layer by layer, a fault jumps.

    python3 benchmarks/probes/parity_drift_probe.py --out $OUT --config qwen3_6_27b --bucket 8
    python3 benchmarks/probes/parity_drift_probe.py --dry-run --out /tmp/pdp     # CPU, tiny, float32
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import Stages, compiled_artifact, engine_script, load_format  # noqa: E402

DEFAULTS = {"gpu": dict(family="qwen3_next", size="bench", iters=1), "dry": dict(family="qwen3_next", size="tiny", iters=1)}


def bench(args, rec: dict, save) -> None:
    from runtime.step.bound_ops import BoundOps
    from runtime.graphs.runner import GraphRunner, ParityError
    from runtime.cache.kv_pool import KVPool
    from runtime.artifact.loader import load_artifact
    from runtime.cache.state_pool import StatePool

    device = torch.device("cpu" if args.dry_run else "cuda")
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)

    def probe():
        """The start-up check itself on one decode bucket: its op-by-op record (GraphRunner.parity.errors)
        is kept whether the key passes or is refused."""
        art = load_artifact(compiled_artifact(args), device=str(device), load_format=load_format(args))
        B = args.bucket
        kv = KVPool(art.registry, 8 * B + 1, 16, device)
        st = StatePool(art.registry, B, device)
        ops = BoundOps(art.backends(kv, st).for_program("main"))
        graphs = None
        if args.dry_run:
            from testkit.graph_cases import RerunGraphs
            graphs = RerunGraphs()
        runner = GraphRunner(art.runner(ops), ops, kv, st, device, decode_buckets=(B,), extend_buckets=(),
                             max_pages_per_seq=8, graphs=graphs)
        try:
            runner.start(int(art.manifest["model"]["vocab_size"]))
            refused = None
        except ParityError as e:
            refused = str(e)
        (key, errors), = runner.parity.errors.items()
        rec["probe"] = {"key": key, "bucket": B, "refused": refused, **errors}

    stages("probe", probe)


def table(rec: dict) -> str:
    p = rec.get("probe")
    if not p:
        return "no probe"
    lines = [f"{p['key']}, {p['real_rows']} real rows: logits rel err {p['logits']:.3g}; "
             f"{'refused: ' + p['refused'] if p['refused'] else 'passed'}",
             f"{'layer':>6} {'op':<16}{'glue':>10}{'op':>10}"]
    lines += [f"{r['layer']:>6} {r['op']:<16}{r['glue']:>10.3g}{r['op_err']:>10.3g}" for r in p["per_op"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    def add_arguments(p):
        p.add_argument("--bucket", type=int, default=8, help="decode bucket B (B - 1 real requests)")
    return engine_script(argv, __doc__, "parity_drift_probe", DEFAULTS, add_arguments, bench, table,
                         lambda a: f"{a.config or a.family + ' ' + a.size}: decode bucket {a.bucket}")


if __name__ == "__main__":
    main()
