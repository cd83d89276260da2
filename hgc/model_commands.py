"""The model commands: `hgc init-model`, `hgc generate` (the eager baseline) and `hgc demo`.

    hgc init-model --family F --size {tiny,small,bench} --seed N -o DIR   seeded random checkpoint
    hgc generate CHECKPOINT_DIR --prompt-ids "1,2,3;4,5" --max-new-tokens N --json
    hgc demo                                                              all of it on a tiny model

`hgc generate` runs the family's eager model on the CPU reference backend: the oracle every
compiled artifact is compared with, so it has no routing table of its own.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from hgc.prompts import check_request_limits, check_vocab, parse_prompt_ids, print_outputs, timing_line
from hgc.serve_command import SEED_LIMIT, float_in, int_at_least

__all__ = ["cmd_init_model", "cmd_generate", "cmd_demo", "add_model_arguments"]


def cmd_init_model(args) -> int:
    from models.loader import init_checkpoint

    out = init_checkpoint(args.family, args.size, args.seed, args.output, overwrite=args.force,
                          shard_bytes=int(args.shard_mb * (1 << 20)) if args.shard_mb else None,
                          log=io.StringIO() if args.quiet else sys.stderr, progress=args.progress)
    print(f"hgc init-model: wrote {out}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    import torch

    from models.loader import build_meta_model, load_checkpoint, load_config
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.step.bound_ops import BoundOps
    from runtime.engine.generate import greedy_generate, make_pools

    prompts = parse_prompt_ids(args.prompt_ids)
    dtype = getattr(torch, args.dtype)
    family, _, text = load_config(args.checkpoint)
    check_vocab(prompts, int(text["vocab_size"]))
    meta = build_meta_model(family, text)  # the limits first: no weights read, nothing allocated
    check_request_limits(prompts, args.max_new_tokens, positions=text.get("max_position_embeddings"),
                         registry=meta.layer_registry, device="cpu",
                         weight_bytes=sum(p.numel() for p in meta.parameters()) * dtype.itemsize)
    family, text, model = load_checkpoint(args.checkpoint, dtype=dtype)
    kv_pool, state_pool = make_pools(model.layer_registry, max(map(len, prompts)) + args.max_new_tokens, len(prompts))
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool))
    model.set_ops(ops)
    start = time.perf_counter()
    outputs = greedy_generate(model, ops, kv_pool, state_pool, prompts, args.max_new_tokens)
    if not args.quiet:
        print(timing_line("generate", outputs, time.perf_counter() - start, "eager model, cpu reference"),
              file=sys.stderr)
    print_outputs(prompts, outputs, args.json)
    return 0


def cmd_demo(args) -> int:
    """The built-in default job: make a tiny hybrid model, generate eagerly, compile, run, compare."""
    import tempfile

    if args.workdir:
        return _demo(args, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="hgc-demo-") as work:  # the checkpoint is the demo's own: removed after
        return _demo(args, Path(work))


def _demo(args, work: Path) -> int:
    import subprocess

    ckpt, art = work / "checkpoint", Path(args.artifacts) / f"demo-{args.family}"
    prompts = "1,2,3,4,5,6,7,8;9,10,11"
    steps = [
        ["init-model", "--family", args.family, "--size", "tiny", "--seed", "0", "-o", str(ckpt), "--force"],
        ["generate", str(ckpt), "--prompt-ids", prompts, "--max-new-tokens", "8", "--json"],
        ["compile", str(ckpt), "-o", str(art), "--force"],
        ["run", str(art), "--prompt-ids", prompts, "--max-new-tokens", "8", "--json"],
    ]
    results = []
    for step in steps:
        print(f"$ hgc {' '.join(step)}", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "hgc", *step], capture_output=True, text=True)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            print(f"hgc demo: step `hgc {step[0]}` failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        if proc.stdout.strip():
            print(proc.stdout.strip())
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]) if "--json" in step else None)
    eager, compiled = results[0]["outputs"], results[1]["outputs"]
    same = [e["output_ids"] for e in eager] == [c["output_ids"] for c in compiled]
    print(f"hgc demo: compiled run {'matches' if same else 'DIFFERS FROM'} the eager baseline", file=sys.stderr)
    return 0 if same else 1


def add_model_arguments(sub) -> None:
    from models.families import FAMILY_IDS, SIZES

    p = sub.add_parser(
        "init-model", help="write a seeded random checkpoint in a family's real format",
        description="Write a seeded random checkpoint of a model family in its real format: config.json, "
                    "safetensors shards (with an index when more than one) and a small trained tokenizer. Sizes: "
                    "tiny (seconds, for tests), small, bench (1.7B parameters: minutes, 3.3 GB).",
        epilog="examples:\n  hgc init-model --family qwen3_next --size tiny -o /tmp/ckpt\n"
               "  hgc init-model --family kimi_linear --size bench --seed 1 -o /data/kimi-bench --shard-mb 1024")
    p.add_argument("--family", required=True, choices=FAMILY_IDS, help="the model family whose format is written")
    p.add_argument("--size", default="tiny", choices=SIZES, help="the preset size")
    p.add_argument("--seed", type=int_at_least(0, SEED_LIMIT), default=0, help="seed of the random weights (same seed, same bytes)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="checkpoint folder to create")
    p.add_argument("--shard-mb", type=float_in(0), default=2048, help="largest safetensors shard (MiB); 0: one file")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output folder (only a checkpoint folder or an empty one is replaced)")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser(
        "generate", help="greedy generation with the eager model (the baseline)",
        description="Greedy generation with the family's eager model on the CPU reference backend: the oracle "
                    "every compiled artifact is compared with. Prints each prompt and its new tokens, a timing "
                    "line on stderr.",
        epilog='example:\n  hgc generate /tmp/ckpt --prompt-ids "1,2,3;4,5" --max-new-tokens 8 --json')
    p.add_argument("checkpoint", help="checkpoint folder: config.json and *.safetensors")
    p.add_argument("--prompt-ids", required=True, help='token ids, prompts separated by ";": "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=16,
                   help="tokens to generate per prompt (checked against the model's positions and free memory)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the model runs in")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "demo", help="init a tiny model, generate, compile, run and compare",
        description="The built-in default job: make a tiny hybrid checkpoint, generate with the eager model, "
                    "compile it to artifacts/demo-FAMILY, run the artifact, and check both give the same tokens.",
        epilog="example:\n  hgc demo --family kimi_linear")
    p.add_argument("--family", default="qwen3_next", choices=FAMILY_IDS, help="the model family of the demo")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="where the checkpoint is written and kept (default: a temporary folder, removed at the end)")
    p.add_argument("--artifacts", default="artifacts", metavar="DIR", help="where the artifact is written")
    p.set_defaults(func=cmd_demo)
