"""Where a speculative run's greedy text leaves plain decoding's, for one request, on one artifact.

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/spec_text_probe.py --out $OUT --work /tmp/probe --batch-invariant

`spec_bench`'s full_acceptance stage forces the drafts to plain decoding's text; when its tokens
then differ, this probe tells which part of a speculative run moves them. One request (a
--prompt-len token prompt, --new-tokens greedy tokens), bench-size qwen3_next, runs in order:

1. plain decoding, twice on one engine and once on a fresh one: is the plain text the same run to run?
2. D = 3 with the real MTP draft: at random weights every round keeps the target's token at row 0
   alone, so only the verify step's first row and its state after one token are used;
3. D = 1 and D = 3 with drafts forced to the first plain run's text (testkit/spec_drafters.ForcedDrafts):
   every row of every verify step is kept until the first difference;
4. D = 3 with no draft program in the rounds (tests/spec_drafters): the plain text proposed
   (every row kept) and the plain text plus one (only row 0 kept). Against 2 and 3, these say
   whether the draft program's steps between the verify steps move the main program's numbers.

Each against the first plain run: how many tokens differ, the first differing token, the first
token whose log-probability differs at all (the same token in both runs, before the texts part:
where the bits part, which may be long before a near tie turns the text), the plain run's top-2
margin at the first differing token, and the draft acceptance. Then each run with the draft program
against its twin without it (the same verify rows kept): where their tokens and log-probabilities
first differ. `--trace-ops` also runs plain decoding and D = 3 forced (with the draft program and
without it) with every step eager under testkit/position_trace.PositionTrace: the first position,
and there the first op, where each run's numbers leave eager plain decoding's. Writes
OUT/spec_text_probe.json. `--dry-run`: the CPU, a tiny model (the script's own test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import bench_engine, compare, compiled_artifact, prompts_for  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True, help="folder for the checkpoint and artifact (reused when there)")
    p.add_argument("--batch-invariant", action="store_true", help="compile with --batch-invariant")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--trace-ops", action="store_true",
                   help="also run plain and D = 3 (drafts forced, with and without the draft program) with every "
                        "step eager under an op trace (testkit/position_trace.py): the first position, and there the "
                        "first op, where each leaves plain decoding's bits")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny size: the script's own test")
    args = p.parse_args(argv)
    from runtime.engine.engine import SamplingParams
    from runtime.artifact.loader import load_artifact
    from testkit.spec_drafters import DisagreeingDrafter, ForcedDrafts, GreedyContinuationDrafter

    device = "cpu" if args.dry_run else "cuda"
    args.family, args.size = "qwen3_next", "tiny" if args.dry_run else "bench"
    art = load_artifact(compiled_artifact(args), device=device)
    vocab = int(art.manifest["model"]["vocab_size"])
    graphs = None
    if args.dry_run:
        from testkit.graph_cases import RerunGraphs
        graphs = RerunGraphs()
    prompt = prompts_for(vocab, [args.prompt_len], seed=1)
    max_len = args.prompt_len + args.new_tokens + 1

    def engine(D: int, wrap=None, eager: bool = False):
        return bench_engine(art, D, device, drafter_wrap=wrap, max_len=max_len, graphs=graphs, eager=eager)

    def text(eng):
        rid = eng.add_request(prompt[0], SamplingParams(max_new_tokens=args.new_tokens, logprobs=2))
        return eng.run_until_done()[rid]

    runs = {}
    plain_engine = engine(0)
    reference = text(plain_engine)  # a request's result: its tokens and their log-probabilities
    runs["plain, again on the same engine"] = (text(plain_engine), None)
    runs["plain, a fresh engine"] = (text(engine(0)), None)
    real = engine(3)
    runs["D = 3, the real draft"] = (text(real), real.speculation())
    plain_text = {tuple(prompt[0]): list(reference.output_ids)}
    for D in (1, 3):
        forced = engine(D, lambda drafter: ForcedDrafts(drafter, plain_text))
        runs[f"D = {D}, drafts forced to the plain text"] = (text(forced), forced.speculation())
    # (the engine still builds and captures the draft program; these drafters never run it)
    no_program = {"the plain text proposed": GreedyContinuationDrafter(plain_text, 3, vocab, device=device),
                  "the plain text plus one": DisagreeingDrafter(plain_text, 3, vocab, device=device)}
    for what, drafter in no_program.items():
        eng = engine(3, lambda _, drafter=drafter: drafter)
        runs[f"D = 3, no draft program, {what}"] = (text(eng), eng.speculation())
    doc = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "batch_invariant": art.batch_invariant, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "runs": {}}
    for name, (result, spec) in runs.items():
        found = compare([list(reference.output_ids)], [list(result.output_ids)], [args.prompt_len])
        first = found["first_diff"]
        bits = first_bits_apart(reference, result, first)
        margin = None
        if first is not None:
            top = reference.logprobs[first].top
            margin = top[0][1] - top[1][1]
        doc["runs"][name] = {"mismatched": found["mismatched"], "first_diff": first, "first_logprob_diff": bits,
                             "plain_margin_at_first_diff": margin,
                             "acceptance_rate": spec["acceptance_rate"] if spec else None}
        print(f"{name:50s} differ {found['mismatched']:4d}, first at token {first}, first log-prob difference at "
              f"token {bits}, acceptance {spec['acceptance_rate'] if spec else '-'}", flush=True)
    # A run with the draft program against the run without it that keeps the same verify rows: the same
    # main-program steps, so any difference in bits comes from the draft program's steps in between.
    # (The real draft's pair is like for like only while the real draft has kept nothing.)
    doc["pairs"] = {}
    for with_program, without in (("D = 3, drafts forced to the plain text",
                                   "D = 3, no draft program, the plain text proposed"),
                                  ("D = 3, the real draft", "D = 3, no draft program, the plain text plus one")):
        a, b = runs[with_program][0], runs[without][0]
        first = compare([list(a.output_ids)], [list(b.output_ids)], [args.prompt_len])["first_diff"]
        bits = first_bits_apart(a, b, first)
        doc["pairs"][f"{with_program} | {without}"] = {"first_diff": first, "first_logprob_diff": bits}
        print(f"{with_program} against {without}: first token difference {first}, first log-prob difference {bits}",
              flush=True)
    if args.trace_ops:
        doc["traced"] = traced_runs(engine, text, reference, plain_text, vocab, device, args.prompt_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_text_probe.json").write_text(json.dumps(doc, indent=1))
    return 0


def traced_runs(engine, text, reference, plain_text, vocab: int, device, prompt_len: int) -> dict:
    """--trace-ops: plain decoding and two D = 3 runs, every step eager under a PositionTrace of the
    main program's ops; each against the eager plain run: tokens, log-probabilities, and the first
    position and op where the numbers part (testkit/position_trace.first_position_parting)."""
    from testkit.position_trace import PositionTrace, first_position_parting
    from testkit.spec_drafters import ForcedDrafts, GreedyContinuationDrafter

    def traced(D: int, wrap=None):
        eng = engine(D, wrap, eager=True)
        trace = PositionTrace(eng.ops)
        try:
            return text(eng), trace
        finally:
            trace.detach()

    plain, plain_trace = traced(0)
    runs = {"D = 3, drafts forced to the plain text": traced(3, lambda drafter: ForcedDrafts(drafter, plain_text)),
            "D = 3, no draft program, the plain text proposed":
                traced(3, lambda _: GreedyContinuationDrafter(plain_text, 3, vocab, device=device))}
    found = compare([list(reference.output_ids)], [list(plain.output_ids)], [prompt_len])["first_diff"]
    doc = {"plain, eager, against plain with graphs": {
        "first_diff": found, "first_logprob_diff": first_bits_apart(reference, plain, found)}}
    print(f"traced: plain, eager against plain with graphs: first token difference {found}, first log-prob "
          f"difference {doc['plain, eager, against plain with graphs']['first_logprob_diff']}", flush=True)
    for name, (result, trace) in runs.items():
        first = compare([list(plain.output_ids)], [list(result.output_ids)], [prompt_len])["first_diff"]
        doc[name] = {"first_diff": first, "first_logprob_diff": first_bits_apart(plain, result, first),
                     "first_parting": first_position_parting(plain_trace, trace)}
        print(f"traced: {name}, eager, against plain eager: first token difference {first}, first log-prob "
              f"difference {doc[name]['first_logprob_diff']}, numbers first part at {doc[name]['first_parting']}",
              flush=True)
    return doc


def first_bits_apart(a, b, first_token_diff: "int | None") -> "int | None":
    """The first token whose log-probability differs at all between results a and b, among the
    tokens before their texts part (the same token in both)."""
    common = min(len(a.logprobs), len(b.logprobs)) if first_token_diff is None else first_token_diff
    return next((j for j in range(common) if a.logprobs[j].logprob != b.logprobs[j].logprob), None)


if __name__ == "__main__":
    raise SystemExit(main())
