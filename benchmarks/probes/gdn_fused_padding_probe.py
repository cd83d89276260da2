"""A fused GDN mixer's extend, padded against unpadded, stage by stage: which launch of triton_linear's
gdn_fused computes a real request differently when its step is padded to a bucket.

Start-up parity runs a bucket's real requests eagerly twice from the same states, padded to the
bucket and unpadded, each op on the padded run's inputs (runtime/graphs/startup_parity.py). Where it
names a gdn_fused layer, this probe repeats those two runs without capturing anything and keeps,
for each gdn_fused call, the real rows of every stage the mixer launches: the extend conv's output,
the l2-normalised q and k, v, the gates g and beta, the recurrent core's output and the gated
norm's; and the layer's conv history and recurrent state of each real request after the step.
The first stage whose real rows differ while its inputs agree is the launch at fault.

    python3 benchmarks/probes/gdn_fused_padding_probe.py --out $OUT                 # on the GPU machine
    TRITON_INTERPRET=1 python3 benchmarks/probes/gdn_fused_padding_probe.py --device cpu --out /tmp/p

--device cpu runs triton_linear's kernels through the Triton interpreter (programs one after
another). Variants (--variants, each a fresh runner over the same artifact): `default`; `sync`
(the device drained after each stage: a race with the host or another stream goes away);
`conv_tile` / `conv_rows` (the extend conv's tile or row-streaming kernel, whatever the table);
`chunk` (no short-extend kernel: the step's core on the chunk kernels). The tiny qwen3_next of the
GPU graph tests (head dim 64, bf16 on cuda), the keys of their refusals by default. JSON to
OUT/gdn_fused_padding_probe.json; one line a variant and key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from compiler.splitops import Mode  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.batch import build_step  # noqa: E402
from runtime.graphs.buckets import CaptureKey  # noqa: E402
from runtime.graphs.parity import CacheWatch, OpTrace, TeacherForcing, rel_err  # noqa: E402
from runtime.graphs.startup_parity import _observed_run, parity_items, release_items  # noqa: E402

VARIANTS = ("default", "sync", "conv_tile", "conv_rows", "chunk", "no_launcher", "f32_dots", "solve_scratch",
            "pad_zero", "pad_nan")


def build_artifact(folder: Path, device: str):
    """The GPU graph tests' artifact (testkit.graph_cases.write_tiny_qwen3_next_hd64), or on the CPU
    the same with gdn_fused on the interpreted triton_linear."""
    from hgc import main
    from runtime.artifact.loader import load_artifact
    from testkit.graph_cases import write_tiny_qwen3_next_hd64

    write_tiny_qwen3_next_hd64(folder / "c")
    if device == "cuda":
        assert main(["compile", str(folder / "c"), "-o", str(folder / "a"), "--target", "cuda", "--no-inductor",
                     "--dtype", "bfloat16", "--no-dumps"]) == 0
        return load_artifact(folder / "a", "cuda"), None
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from hgc.wiring import toolchain
    from runtime.backends import discover
    from testkit.linear_cases import interpreted_triton_linear

    interpreted = interpreted_triton_linear()
    registry = discover().with_classes(interpreted, source="gdn_fused_padding_probe")
    compile_checkpoint(folder / "c", folder / "a",
                       CompileConfig(routes=(parse_route(f"gdn_fused={interpreted.name}"),), dtype="bfloat16"),
                       toolchain(registry), dumps=False)
    return load_artifact(folder / "a"), registry


def make_runner(art, registry, device: str):
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.step.bound_ops import BoundOps

    kv, st = make_pools(art.registry, 128, 8, page_size=16, device=device, kv_dtype=torch.bfloat16)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    return GraphRunner(art.runner(ops), ops, kv, st, device, decode_buckets=(4,), extend_buckets=(16, 64, 512, 1024),
                       max_pages_per_seq=80, extend_max_seqs=4)


class StageRecorder:
    """Wraps a triton_linear member's short_conv and _gdn_core and its fused kernels' qk_gates and
    gated_rmsnorm: per gdn_fused call, clones of each stage's first `rows` rows."""

    def __init__(self, member, sync: bool):
        self.member, self.sync, self.rows, self.pad_fill = member, sync, 0, None
        self.calls: list[dict] = []
        self._fused = importlib.import_module("runtime.backends.kernels.gdn_fused")  # the mixer's kernels
        self._saved = (self._fused.qk_gates, self._fused.gated_rmsnorm)
        self._wrap()

    def _keep(self, name, t):
        if t is None:  # no beta (a gate-only core)
            return
        if self.sync and t.is_cuda:
            torch.cuda.synchronize()
        self.calls[-1][name] = t[:self.rows].float().clone()

    def _wrap(self):
        member, fused, keep = self.member, self._fused, self._keep
        short_conv, gdn_core = member.short_conv, member._gdn_core
        qk_gates, gated_rmsnorm = self._saved
        recorder = self

        def conv(ctx, x, weight, bias, out, layer_id, silu):
            recorder.calls.append({"layer": int(layer_id), "qkv": x[:recorder.rows].float().clone()})
            short_conv(ctx, x, weight, bias, out, layer_id, silu)
            keep("conv", out)

        def gates(*args, **kwargs):
            q, k, v, g, beta = qk_gates(*args, **kwargs)
            for name, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
                keep(name, t)
            return q, k, v, g, beta

        def core(ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding=True):
            if recorder.pad_fill is not None and q.shape[0] > recorder.rows:
                for t in (q, k, v, g, beta):
                    t[recorder.rows:] = recorder.pad_fill
            gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding)
            keep("core", out)

        def norm(core_out, z, norm_weight, out, eps, **kwargs):
            gated_rmsnorm(core_out, z, norm_weight, out, eps, **kwargs)
            keep("norm", out)

        member.short_conv, member._gdn_core = conv, core
        fused.qk_gates, fused.gated_rmsnorm = gates, norm

    def restore(self):
        del self.member.short_conv, self.member._gdn_core
        self._fused.qk_gates, self._fused.gated_rmsnorm = self._saved


def apply_variant(member, variant: str) -> None:
    """Sets what `variant` changes for every later runner of the process (the probe runs one variant
    a process where it changes module state: no_launcher, f32_dots, solve_scratch)."""
    from runtime.backends.kernels import chunk
    from runtime.backends.kernels.launch_cache import Launcher

    if variant == "no_launcher":
        Launcher.enabled = False
    elif variant in ("f32_dots", "solve_scratch"):
        override = {"f32_dots": {"low_precision_dots": False}, "solve_scratch": {"solve_in_registers": False}}[variant]
        config = chunk.chunk_config
        chunk.chunk_config = lambda *a, **k: dataclasses.replace(config(*a, **k), **override)
    elif variant == "conv_tile":
        member.conv_extend_rows = False
    elif variant == "conv_rows":
        member.conv_extend_rows = True
    elif variant == "chunk":
        member.short_extend_tokens = 0


def probe_key(runner, member, key: CaptureKey, variant: str) -> dict:
    """The two eager runs of start-up parity for `key`, each gdn_fused stage's real rows compared."""
    items = parity_items(runner, key, 256, torch.Generator().manual_seed(0))
    try:
        padded = build_step(items, runner.kv_pool, "cpu", mode=key.mode, pad_tokens_to=key.tokens,
                            pad_seqs_to=key.seqs, max_pages=runner.max_pages)
        plain = build_step(items, runner.kv_pool, "cpu", mode=key.mode, max_pages=runner.max_pages)
        rows = plain.ctx.num_real_tokens
        padded = runner.staging.with_random_hidden(padded, torch.Generator().manual_seed(rows))
        plain = dataclasses.replace(plain, hidden=None if padded.hidden is None else padded.hidden[:rows])
        slots = [seq.slot for seq, _ in items]
        watch = CacheWatch(runner.kv_pool, runner.state_pool, slots, [p for seq, _ in items for p in seq.pages])
        runs = {}
        for name, step in (("padded", padded), ("plain", plain)):
            recorder = StageRecorder(member, sync=variant == "sync")
            recorder.rows = rows
            recorder.pad_fill = {"pad_zero": 0.0, "pad_nan": float("nan")}.get(variant)
            try:
                if name == "padded":
                    reference = OpTrace(rows, inputs=True)
                    logits = _observed_run(runner, step, None, observer=reference)
                else:
                    logits = _observed_run(runner, step, None, intercept=TeacherForcing(reference.records))
            finally:
                recorder.restore()
            runs[name] = (recorder.calls, logits, watch.written())
            watch.restore()
        (pad_calls, pad_logits, pad_states), (plain_calls, plain_logits, plain_states) = runs["padded"], runs["plain"]
        stages = []
        for a, b in zip(pad_calls, plain_calls):
            stages.append({"layer": a["layer"], **{
                name: {"rel_err": rel_err(b[name], a[name]), "nan_padded": int(a[name].isnan().sum()),
                       "nan_plain": int(b[name].isnan().sum())} for name in a if name != "layer" and name in b}})
        states = {f"{where} {layer} {entry}": rel_err(plain_states[(where, layer, entry)], t)
                  for (where, layer, entry), t in pad_states.items() if where == "state"}
        return {"variant": variant, "key": str(key), "real_requests": len(items), "real_rows": rows,
                "lens": [len(t) for _, t in items], "slots": slots,
                "logits_rel_err": rel_err(plain_logits[0], pad_logits[0]), "stages": stages, "states": states}
    finally:
        release_items(runner, items)


def first_fault(record: dict, rtol: float = 2e-2) -> str:
    """The first stage of the first gdn_fused call (in the step's order) whose real rows differ
    beyond rtol, or hold NaN in either run: "layer L stage: ..."; "none" where none does."""
    for call in record["stages"]:
        for name, r in call.items():
            if name != "layer" and (not r["rel_err"] < rtol or r["nan_padded"] or r["nan_plain"]):
                return (f"layer {call['layer']} {name}: rel err {r['rel_err']:.3g}, "
                        f"nan {r['nan_padded']}/{r['nan_plain']}")
    return "none"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gdn_fused_padding_probe.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--keys", default="64x4,1024x4", help="extend buckets TOKENSxREQUESTS (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of %s (default: all)" % ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {', '.join(bad)} (choose from {', '.join(VARIANTS)})")
    keys = [CaptureKey(Mode.EXTEND, *map(int, k.split("x"))) for k in args.keys.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        art, registry = build_artifact(Path(tmp), args.device)
        for variant in variants:
            runner = make_runner(art, registry, args.device)
            member = next(m for m in runner.ops.backend.members.values() if isinstance(m, TritonLinearBackend))
            apply_variant(member, variant)
            for key in keys:
                record = probe_key(runner, member, key, variant)
                records.append(record)
                print(f"{variant:10s} {key}: logits rel err {record['logits_rel_err']:.3g}; first fault: "
                      f"{first_fault(record)}; states {json.dumps(record['states'])}", flush=True)
                (out / "gdn_fused_padding_probe.json").write_text(json.dumps(
                    {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "env": {k: os.environ[k] for k in ("CUDA_LAUNCH_BLOCKING",) if k in os.environ},
                     "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
