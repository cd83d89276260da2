"""Speculative decoding benchmark: what a target_verify step costs against a decode step, tokens per
second at full acceptance against plain decoding, and greedy tokens with drafts against without.

On the GPU machine, one run:

    python3 benchmarks/serving/spec_bench.py --out $OUT               # qwen3_next, bench size, bf16, CUDA graphs
    python3 benchmarks/serving/spec_bench.py --dry-run --out /tmp/sb  # CPU: tiny size, float32, reference backend,
                                                                      # graphs rerun (testkit/graph_cases.py)
    python3 benchmarks/serving/spec_bench.py --out $OUT --dtype float32 --skip step_cost,full_acceptance \
        --route gqa_attention=torch_reference --route "gdn_core=triton_linear[chunk_impl=triton]"
                                      # the equality stages in float32: rounding or a fault? (GQA on a
                                      # float32 backend; GDN extends off FLA, whose kernels take float32
                                      # operands as tf32)
    python3 benchmarks/serving/spec_bench.py --out $OUT --config qwen3_6_27b --skip verify_vs_decode,greedy_equal
                                      # a published release's shape (tests/configs), random weights:
                                      # where the draft's steps weigh less against the main model's
    python3 benchmarks/serving/spec_bench.py --out $OUT --batch-invariant
                                      # an artifact compiled with --batch-invariant: verify rows the
                                      # decode steps' bits, greedy tokens with drafts plain decoding's

1. init_compile: `hgc init-model` (its config has one MTP layer), `hgc compile` (on the GPU:
   --target cuda --dtype bfloat16, or --dtype; tolerances follow the dtype).
2. step_cost: one GraphRunner over the main program with decode buckets and target_verify buckets
   of D + 1 tokens (--batches, default 1, 8, 32; D = --draft-tokens, default 3), started (captured,
   parity-checked). Per batch B: B requests with a 64-token history; their decode step and their
   verify step of D + 1 tokens each, replayed from the graphs; median milliseconds and the ratio
   verify / decode (goal at batch 1: <= 1.3). After every timing, each step is profiled: kernels
   per step, their time, and the kernels a verify step pays more for than a decode step. Last,
   a draft step's logits product alone (the lm_head's shape, one row, the draft's products),
   profiled, which with the batch-1 profiles gives `speedup_bound`: the most full acceptance can
   give at the kernels' time were the draft's layer free (D + 1 decode steps' kernels over a
   verify step's and D one-row lm_head products).
3. verify_vs_decode: whether a verify step computes what decode steps compute
   (testkit/spec_checks.verify_against_decode): twin requests with the same history, one verified
   with D + 1 tokens, the other fed them by D + 1 decode steps, through a GraphRunner with decode
   and verify buckets 1 and 8 (graphs replayed); per batch, the relative error of each row's
   logits, the argmax disagreements and the decode row's top-2 log-prob margin at each. A fault
   in a verify path moves every row; bf16 rounding moves them by a few 1e-3 (an expert of a
   random-weight router flipped on that rounding, more). Goal: median row error within the
   start-up parity tolerance for bf16 (runtime/graphs/parity.py), argmax flips only at near ties. The
   same twins again, every step eager under an op trace (`trace_ops`): where each row's bits
   first part from the decode step's, the op handed other inputs or the op that computed
   another output (`eager_traced`).
4. full_acceptance: one request (--prompt-len tokens, --new-tokens to generate) through an engine
   as `hgc serve` builds it (pools, backend, graph runners, the draft's too), plain, then with D
   drafts where the MTP draft program runs as usual and each token it proposes is replaced by
   the target's own greedy continuation (testkit/spec_drafters.ForcedDrafts): every draft is kept,
   at the draft's real cost. Decode tokens per second of each, and the speedup (goal at D = 3,
   batch 1: >= 2.5x). Both outputs must be the same tokens. Also the speedup the measured step
   costs give when every step keeps D + 1 tokens: in bf16 a near tie decided the other way by
   the verify kernels sends the run down another text, after which no forced draft agrees. So
   when the tokens differ, the run is repeated forced to its own output (a request's verify steps
   all have D + 1 rows, so its greedy text does not depend on what earlier rounds kept): that
   rerun keeps every draft, and the speedup target takes it. Then the same engine with the draft's step after each verify moved back after the round's
   read (SpeculativeDecoder.draft_before_read = False), alternated with the default order, three
   runs each: the ratio of their median rates. With --batch-invariant, likewise the draft's graphs
   as served (torch's products) against an engine whose draft graphs hold the fixed-order
   products (`draft_products`). Last, one plain step and one round profiled
   (kernels, device idle, and the Python functions that issue them), and from them the speedup
   at the kernels' time alone (D + 1 plain steps' kernels over one round's): the bound with the
   host hidden entirely.
5. greedy_equal: --prompts prompts of random lengths, --equal-tokens new tokens each, greedy,
   through a plain engine and one with the real MTP draft (D drafts): the tokens must be equal;
   any difference is reported with where it starts, with the acceptance rate the real draft
   reached. Both runs ask for top-2 log-probs, so each prompt's first difference comes with the
   plain run's margin between its two most likely tokens there and that margin's rank among all
   plain tokens' margins (near 0: a near tie decided the other way by differently shaped bf16
   kernels; after it the two runs continue different texts, so every later token differs too),
   and the tokens before it with how far the two runs' log-probs of the same token were apart.
Timings: medians of --iters runs between CUDA events (perf_counter on the CPU); engine tokens per
second from Engine.timing(). Every stage is wrapped (bench_common.Stages); JSON to
OUT/spec_bench.json after each stage, a table last.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import (Stages, bench_engine, compare, compiled_artifact, engine_script, fmt,  # noqa: E402
                          host_profile, load_format, profile_call, prompts_for, synchronizer, target_rows, time_ms)
from compiler.splitops import Mode  # noqa: E402
from runtime.cache.batch import SeqState, build_step, commit_step  # noqa: E402
from runtime.engine.engine import SamplingParams  # noqa: E402

GPU_DEFAULTS = dict(family="qwen3_next", size="bench", batches="1,8,32", prompt_len=128, new_tokens=256,
                    prompts=32, equal_tokens=64, iters=20)
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", batches="1,2,4", prompt_len=8, new_tokens=12,
                    prompts=4, equal_tokens=8, iters=2)
TARGET_VERIFY_RATIO = 1.3  # verify step (D = 3) / decode step, batch 1
TARGET_SPEEDUP = 2.5  # tokens/s at full acceptance / plain decode, D = 3, batch 1
HISTORY = 64
# verify_vs_decode: requests per batch and their history lengths (pages of 16 tokens; the dry run's are shorter)
# past 256 keys: several attention splits (284: where a lone request's D = 3 text left plain decoding's, BENCHMARKS.md)
TWIN_HISTORIES = {1: [284], 8: [5, 16, 37, 64, 129, 255, 300, 700]}
DRY_TWIN_HISTORIES = {2: [3, 18]}


def bench(args, rec: dict, save) -> None:
    from runtime.artifact.loader import load_artifact

    device = torch.device("cpu" if args.dry_run else "cuda")
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    D, batches = args.draft_tokens, [int(b) for b in args.batches.split(",")]
    if args.torch_sums and not args.batch_invariant:
        raise SystemExit("--torch-sums: only with --batch-invariant (without it torch's sums run anyway)")
    rec["torch_sums"] = args.torch_sums
    rec["dtype"] = args.dtype or ("float32" if args.dry_run else "bfloat16")  # what the tolerances are for
    # A dry run checks the bookkeeping, not the numbers: its step profiles take --iters calls (the GPU
    # run keeps profile_call's own count)
    profiled = {"iters": args.iters} if args.dry_run else {}
    state: dict = {}

    def init_compile():
        state["art"] = load_artifact(compiled_artifact(args), device=str(device), load_format=load_format(args))
        if args.torch_sums:  # the products stay batch-invariant; sums and means go back to torch
            from runtime.backends import batch_invariant_aten
            batch_invariant_aten.uninstall()
            batch_invariant_aten.install(sums=False)
        state["vocab"] = int(state["art"].manifest["model"]["vocab_size"])

    def graphs():
        if args.dry_run:
            from testkit.graph_cases import RerunGraphs
            return RerunGraphs()
        return None  # CudaGraphs

    def main_runner(buckets: list[int], slots: int, max_len: int, extend_max_seqs: int = 1):
        """A started GraphRunner of the main program with decode and verify buckets, over pools of
        `slots` requests of up to max_len tokens each (backends as routing.json names them)."""
        from runtime.step.bound_ops import BoundOps
        from runtime.graphs.runner import GraphRunner
        from runtime.cache.kv_pool import KVPool
        from runtime.cache.state_pool import StatePool

        art, page = state["art"], 16
        pages_per_seq = -(-max_len // page)
        kv = KVPool(art.registry, slots * pages_per_seq + 1, page, device)
        st = StatePool(art.registry, slots, device, draft_tokens=D, verify_rows=max(buckets))
        ops = BoundOps(art.backends(kv, st).for_program("main"))
        runner = GraphRunner(art.runner(ops), ops, kv, st, device, decode_buckets=buckets, extend_buckets=(),
                             verify_buckets=buckets, verify_tokens=D + 1, max_pages_per_seq=pages_per_seq,
                             extend_max_seqs=extend_max_seqs, graphs=graphs())
        runner.start(state["vocab"], log=lambda line: print(f"  {line}", flush=True))
        return runner, kv, st

    def step_cost():
        runner, kv, st = main_runner(batches, sum(batches), HISTORY + D + 2)  # every batch held until profiled
        g = torch.Generator().manual_seed(0)
        out, held = {}, []
        for B in batches:
            seqs = [SeqState(st.alloc()) for _ in range(B)]
            for s in seqs:  # the history, eagerly
                items = [(s, torch.randint(1, state["vocab"], (HISTORY,), generator=g).tolist())]
                runner.run(build_step(items, kv, "cpu", max_pages=runner.max_pages), None)
                commit_step(items)
            decode, decode_key = runner.build([(s, [5]) for s in seqs])
            verify, verify_key = runner.build([(s, [5] * (D + 1)) for s in seqs], mode=Mode.TARGET_VERIFY,
                                              logits_rows=[D + 1] * B)
            assert decode_key is not None and verify_key is not None, (decode_key, verify_key)
            decode_ms = time_ms(lambda: runner.run(decode, decode_key), device, args.iters)
            verify_ms = time_ms(lambda: runner.run(verify, verify_key), device, args.iters)
            out[str(B)] = {"decode_ms": decode_ms, "verify_ms": verify_ms, "ratio": verify_ms / decode_ms,
                           "decode_key": str(decode_key), "verify_key": str(verify_key)}
            held.append((B, seqs, decode, decode_key, verify, verify_key))
        # Where a verify step's time goes against a decode step's: profiled after every timing (a
        # profile slows what is timed after it in the process: bench_common, TEARDOWN_CUPTI).
        for B, seqs, decode, decode_key, verify, verify_key in held:
            row = out[str(B)]
            every = {}  # every kernel of each step: one outside a step's top 25 still counts in the difference
            for name, step, key in (("decode", decode, decode_key), ("verify", verify, verify_key)):
                prof = profile_call(lambda step=step, key=key: runner.run(step, key), device, top=None, **profiled)
                every[name] = prof["top_kernels"]
                row[f"{name}_profile"] = {**{k: prof[k] for k in ("kernel_ms", "kernels_per_call", "device_idle_ms")
                                             if k in prof}, "top_kernels": prof["top_kernels"][:25]}
            row["verify_minus_decode_by_kernel"] = kernel_difference(every["decode"], every["verify"])
            for s in seqs:
                kv.free(s.pages)
                st.free(s.slot)
        rec["step_cost"] = out
        rec["lm_head_ms"] = lm_head_ms()
        rec["step_cost_runner"] = {"full_modes": sorted(m.value for m in runner.full_modes),
                                   "counters": dict(runner.counters)}

    def lm_head_ms() -> dict:
        """A draft step's logits product alone, in the lm_head's shape and dtype ([V, H] random
        weights, one row) and with the draft's products (torch's, also under --batch-invariant:
        runtime/engine/speculative.py): its kernel time per call from the profiler, as the steps' kernel
        times above are taken (an eager call timed between events would count its launch too)."""
        from runtime.backends import batch_invariant_aten

        model = state["art"].manifest["model"]
        dtype = getattr(torch, rec["dtype"])
        weight = torch.randn(model["vocab_size"], model["hidden_size"], dtype=dtype, device=device)
        h = torch.randn(1, model["hidden_size"], dtype=dtype, device=device)
        with batch_invariant_aten.products_to_torch():
            prof = profile_call(lambda: torch.nn.functional.linear(h, weight), device, iters=args.iters, top=3)
        return {"kernel_ms": prof["kernel_ms"], "host_issue_ms": prof["host_issue_ms"],
                "kernels": [k["name"] for k in prof["top_kernels"]]}

    def verify_vs_decode():
        from runtime.graphs.parity import rtol_for
        from testkit.spec_checks import verify_against_decode

        histories = DRY_TWIN_HISTORIES if args.dry_run else TWIN_HISTORIES
        buckets = sorted(histories)
        longest = max(n for lens in histories.values() for n in lens) + 2 * (D + 1)
        runner, _, _ = main_runner(buckets, 2 * max(buckets), longest, extend_max_seqs=2 * max(buckets))
        g = torch.Generator().manual_seed(4)
        out = {}
        for B, lens in histories.items():
            same = torch.Generator()
            same.set_state(g.get_state())  # the traced run's histories and tokens are these twins'
            found = verify_against_decode(runner, state["vocab"], lens, D, g)
            traced = verify_against_decode(runner, state["vocab"], lens, D, same, trace_ops=True)["rows"]
            partings = collections.Counter("none" if r["parting"] is None else
                                           "layer {layer} {op} {at}".format(**r["parting"]) for r in traced)
            errs = sorted(r["rel_err"] for r in found["rows"])
            flips = [r for r in found["rows"] if not r["argmax_equal"]]
            out[str(B)] = {"keys": [str(k) if k is not None else "eager" for k in found["keys"]],
                           "rows": len(errs), "median_rel_err": errs[len(errs) // 2], "max_rel_err": errs[-1],
                           "rows_over_tolerance": sum(e > rtol_for(getattr(torch, rec["dtype"])) for e in errs),
                           "argmax_flips": len(flips), "flip_margins": [r["margin"] for r in flips],
                           "median_margin": sorted(r["margin"] for r in found["rows"])[len(errs) // 2],
                           "per_row": found["rows"],
                           "eager_traced": {"rows_parted": sum(r["parting"] is not None for r in traced),
                                            "max_rel_err": max(r["rel_err"] for r in traced),
                                            "first_partings": dict(partings.most_common()), "per_row": traced}}
        rec["verify_vs_decode"] = out

    def engine(draft_tokens: int, drafter_wrap=None, slots: int = 1, max_len: int = 0, fixed_draft_products=False):
        return bench_engine(state["art"], draft_tokens, device, drafter_wrap=drafter_wrap, slots=slots,
                            max_len=max_len, graphs=graphs(), fixed_draft_products=fixed_draft_products)

    def generate(eng, prompts: list[list[int]], new: int, logprobs=None) -> list:
        """Greedy tokens of each prompt; with `logprobs` (k), each prompt's results (tokens and log-probs)."""
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=new, logprobs=logprobs)) for p in prompts]
        results = eng.run_until_done()
        return [results[i] if logprobs else list(results[i].output_ids) for i in ids]

    def decode_rate(eng, prompts, new) -> tuple[list[list[int]], dict]:
        """Tokens and the decode steps' numbers of one timed run, after an untimed warm-up run
        (first-call costs: lazy modules, allocations)."""
        generate(eng, prompts, 4)
        mark = eng.step_records()[-1]
        tokens = generate(eng, prompts, new)
        # The steps after `mark`. (The engine keeps only its recent step records: their count stops
        # growing once it is full, and a run longer than it leaves `mark` out, every record then new.)
        records = eng.step_records()
        after = next((i + 1 for i, r in enumerate(records) if r is mark), 0)
        decode = [r for r in records[after:] if r.prefill_tokens == 0]
        seconds, sampled = sum(r.seconds for r in decode), sum(r.sampled for r in decode)
        return tokens, {"tokens_per_s": sampled / seconds, "steps": len(decode), "tokens": sampled,
                        "s_per_step": seconds / len(decode)}

    def full_acceptance():
        from testkit.spec_drafters import ForcedDrafts

        prompt = prompts_for(state["vocab"], [args.prompt_len], seed=1)
        max_len = args.prompt_len + args.new_tokens + 1
        plain_engine = engine(0, max_len=max_len)
        plain, a = decode_rate(plain_engine, prompt, args.new_tokens)
        references = {tuple(prompt[0]): plain[0]}
        spec_engine = engine(D, lambda drafter: ForcedDrafts(drafter, references), max_len=max_len)
        spec, b = decode_rate(spec_engine, prompt, args.new_tokens)
        # What the measured step costs give if every step keeps D + 1 tokens: in bf16 one near tie decided
        # otherwise by the verify kernels ends the agreement with the plain run's tokens for good (the
        # drafts then follow another text), and with it the measured speedup's meaning.
        rec["full_acceptance"] = full = {"plain": a, "spec": b, "speedup": b["tokens_per_s"] / a["tokens_per_s"],
                                         "speedup_if_all_kept": (D + 1) * a["s_per_step"] / b["s_per_step"],
                                         "same_tokens": plain == spec, "speculative": spec_engine.speculation(),
                                         "difference": compare(plain, spec, [args.prompt_len])}
        if plain != spec:
            # The forced drafts followed plain decoding's text, which the verify steps left at a near
            # tie. Every verify step of one request has the same rows (D + 1), so its greedy text
            # does not depend on what earlier rounds kept: forced to that text (the first run's own
            # output), every draft is the target's argmax again. Timed the same way, on the same engine.
            references[tuple(prompt[0])] = spec[0]
            before = spec_engine.speculation()
            own, c = decode_rate(spec_engine, prompt, args.new_tokens)
            after = spec_engine.speculation()
            drafted = after["drafted"] - before["drafted"]
            full["own_text"] = {**c, "speedup": c["tokens_per_s"] / a["tokens_per_s"], "same_tokens_as_first": own == spec,
                                "acceptance_rate": (after["accepted"] - before["accepted"]) / drafted if drafted else None}
            spec = own
        # Baseline, same engine: the draft's step after each verify run after the round's read, from
        # the host's kept tokens (the order before `after_verify_on_device`). Alternated with the
        # default order, three runs each; medians of tokens per second.
        rates = {True: [b["tokens_per_s"]], False: []}
        if "own_text" in full:
            rates[True] = [full["own_text"]["tokens_per_s"]]
        for before in (False, True, False, True, False):
            spec_engine.spec.draft_before_read = before
            tokens, r = decode_rate(spec_engine, prompt, args.new_tokens)
            assert tokens == spec, "the two orders of a round must give the same tokens"
            rates[before].append(r["tokens_per_s"])
        spec_engine.spec.draft_before_read = True
        rec["full_acceptance"]["draft_order"] = {
            "before_read_tokens_per_s": rates[True], "after_read_tokens_per_s": rates[False],
            "ratio_of_medians": statistics.median(rates[True]) / statistics.median(rates[False])}
        if args.batch_invariant and not args.torch_sums:
            rec["full_acceptance"]["draft_products"] = draft_products_baseline(spec_engine, spec, prompt, references)
        # Where a round's time goes on the device against a plain step's, after every timing above.
        profiles = rec["full_acceptance"]["step_profiles"] = {
            "plain": engine_step_profile(plain_engine, prompt[0], args.new_tokens),
            "spec": engine_step_profile(spec_engine, prompt[0], args.new_tokens)}
        # The speedup if the host cost nothing: D + 1 plain steps' kernel time over one round's (on
        # the CPU, no kernel is timed). What no host-side change can lift.
        if profiles["spec"].get("kernel_ms"):
            rec["full_acceptance"]["kernel_floor_speedup"] = (
                (D + 1) * profiles["plain"]["kernel_ms"] / profiles["spec"]["kernel_ms"])

    def draft_products_baseline(spec_engine, tokens, prompt, references) -> dict:
        """--batch-invariant: the draft's graphs as served (torch's products, runtime/engine/speculative.py)
        against the same engine built with them captured on the fixed-order products, alternated,
        three runs each: the ratio of their median tokens per second; the same tokens asserted."""
        from testkit.spec_drafters import ForcedDrafts

        fixed_engine = engine(D, lambda drafter: ForcedDrafts(drafter, references),
                              max_len=args.prompt_len + args.new_tokens + 1, fixed_draft_products=True)
        rates = {"torch": [], "fixed": []}
        for name in ("fixed", "torch") * 3:
            got, r = decode_rate(spec_engine if name == "torch" else fixed_engine, prompt, args.new_tokens)
            assert got == tokens, f"the draft on {name} products must give the same tokens"
            rates[name].append(r["tokens_per_s"])
        return {"torch_products_tokens_per_s": rates["torch"], "fixed_products_tokens_per_s": rates["fixed"],
                "ratio_of_medians": statistics.median(rates["torch"]) / statistics.median(rates["fixed"])}

    def engine_step_profile(eng, prompt: list[int], new: int) -> dict:
        """One engine step of a request past its prefill, profiled (bench_common.profile_call): kernel
        time and count, the device's span and idle time inside the step, the host's time to issue it
        and the costliest kernels. A speculative step is a whole round: drafts and verify."""
        eng.add_request(prompt, SamplingParams(max_new_tokens=new))
        # Step through the prompt. (The engine keeps only its recent step records, so their count
        # says nothing once it is full: each step's own record does.)
        for _ in range(len(prompt) + 2):
            eng.step()
            if not eng.step_records()[-1].prefill_tokens:
                break
        else:
            raise RuntimeError(f"no decode step after {len(prompt) + 2} steps of a {len(prompt)}-token prompt")
        prof = profile_call(eng.step, device, top=25, **profiled)
        # The host's share: which Python functions issue a step (a round's drafts, verify and reads).
        prof["host_functions"] = host_profile(eng.step, iters=10, top=25, sync=synchronizer(device))
        eng.run_until_done()
        return {k: prof[k] for k in ("host_issue_ms", "kernel_ms", "kernels_per_call", "device_span_ms",
                                     "device_idle_ms", "top_kernels", "top_host_ops", "longest_gaps",
                                     "kernel_sequence", "host_functions") if k in prof}

    def greedy_equal():
        lens = [int(n) for n in torch.randint(4, 2 * args.prompt_len, (args.prompts,),
                                             generator=torch.Generator().manual_seed(2))]
        prompts = prompts_for(state["vocab"], lens, seed=3)
        max_len = max(lens) + args.equal_tokens + 1
        plain_results = generate(engine(0, slots=args.prompts, max_len=max_len), prompts, args.equal_tokens, 2)
        spec_engine = engine(D, slots=args.prompts, max_len=max_len)
        spec_results = generate(spec_engine, prompts, args.equal_tokens, 2)
        plain = [list(r.output_ids) for r in plain_results]
        spec = [list(r.output_ids) for r in spec_results]
        rec["greedy_equal"] = {**compare(plain, spec, lens), "equal": plain == spec,
                               "acceptance_rate": spec_engine.speculation()["acceptance_rate"],
                               "tokens_per_verify": spec_engine.speculation()["tokens_per_verify"],
                               "ties": tie_report(plain_results, spec_results)}

    stages("init_compile", init_compile)
    stages("step_cost", step_cost, needs=("init_compile",))
    stages("verify_vs_decode", verify_vs_decode, needs=("init_compile",))
    stages("full_acceptance", full_acceptance, needs=("init_compile",))
    stages("greedy_equal", greedy_equal, needs=("init_compile",))
    targets(rec, D)


def kernel_difference(decode: list[dict], verify: list[dict], top: int = 12) -> list[dict]:
    """Per kernel name, verify's ms per step minus decode's (profile_call's kernel rows, every kernel
    of each step: a name missing from one step ran no kernel of that name there), the largest
    differences first: which kernels a verify step pays more for."""
    d, v = ({r["name"]: r["ms"] for r in rows} for rows in (decode, verify))
    rows = [{"name": n, "decode_ms": d.get(n, 0.0), "verify_ms": v.get(n, 0.0),
             "extra_ms": round(v.get(n, 0.0) - d.get(n, 0.0), 4)} for n in set(d) | set(v)]
    return sorted(rows, key=lambda r: -abs(r["extra_ms"]))[:top]


def _margin(entry) -> float:
    """The gap between the two most likely tokens' log-probs of one TokenLogprob (top-2 asked for)."""
    return entry.top[0][1] - entry.top[1][1]


def tie_report(plain_results, spec_results) -> dict:
    """Where greedy tokens with drafts first differ from plain decoding's, how close a call each was.

    first_diffs: per differing prompt, the position, both runs' top-2 margins there, and the
    plain margin's rank among all plain tokens' margins (0: the closest call of the run).
    matched_logprob_delta: |plain - spec| log-prob of the same token at the positions before each
    prompt's first difference: how far the two runs' numbers were apart where they agreed."""
    margins = sorted(_margin(e) for r in plain_results for e in r.logprobs)
    first_diffs, deltas = [], []
    for i, (a, b) in enumerate(zip(plain_results, spec_results)):
        pos = next((j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), None)
        end = len(a.logprobs) if pos is None else pos
        deltas += [abs(a.logprobs[j].logprob - b.logprobs[j].logprob) for j in range(min(end, len(b.logprobs)))]
        if pos is not None:
            m = _margin(a.logprobs[pos])
            rank = sum(x < m for x in margins) / max(len(margins), 1)
            first_diffs.append({"prompt": i, "position": pos, "plain_margin": m,
                                "spec_margin": _margin(b.logprobs[pos]), "plain_margin_rank": rank})
    deltas.sort()
    return {"first_diffs": first_diffs,
            "median_plain_margin": margins[len(margins) // 2] if margins else None,
            "worst_first_diff_rank": max((d["plain_margin_rank"] for d in first_diffs), default=None),
            "matched_logprob_delta": {"median": deltas[len(deltas) // 2] if deltas else None,
                                      "max": deltas[-1] if deltas else None}}


def speedup_bound(rec: dict, D: int) -> dict | None:
    """The most a round can give over plain decoding at the kernels' time, batch 1, were the draft's
    layer free: D + 1 decode steps' kernels over one verify step's kernels plus D lm_head products
    of one row (each draft token is the argmax of a full-vocabulary product of the draft's hidden
    state). No kernel of the draft's layer can lift a goal above it; a measured speedup above it
    comes from the host time that plain decoding pays every step and a round once for D + 1 tokens."""
    cost, lm = rec.get("step_cost", {}).get("1"), rec.get("lm_head_ms")
    if not cost or not lm or not lm.get("kernel_ms") or not cost.get("decode_profile", {}).get("kernel_ms"):
        return None  # on the CPU no kernel is timed
    decode, verify = cost["decode_profile"]["kernel_ms"], cost["verify_profile"]["kernel_ms"]
    return {"decode_kernel_ms": decode, "verify_kernel_ms": verify, "lm_head_row_ms": lm["kernel_ms"],
            "speedup": (D + 1) * decode / (verify + D * lm["kernel_ms"])}


def targets(rec: dict, D: int) -> None:
    out = {}
    rec["speedup_bound"] = speedup_bound(rec, D)
    cost = rec.get("step_cost", {}).get("1")
    if cost:
        out["verify_over_decode_b1"] = {"value": cost["ratio"], "goal": f"<= {TARGET_VERIFY_RATIO} (D = {D})",
                                        "met": cost["ratio"] <= TARGET_VERIFY_RATIO}
    versus = rec.get("verify_vs_decode")
    if versus:
        from runtime.graphs.parity import rtol_for

        worst, rtol = max(v["median_rel_err"] for v in versus.values()), rtol_for(getattr(torch, rec["dtype"]))
        out["verify_matches_decode"] = {"value": worst, "goal": f"median row rel err <= {rtol}", "met": worst <= rtol}
    full = rec.get("full_acceptance")
    if full:
        # The run whose every draft was kept: forced to plain decoding's text, or else to its own (above).
        own = full.get("own_text")
        kept = full if full["same_tokens"] or own is None else own
        kept_all = full["same_tokens"] or (own is not None and own["same_tokens_as_first"] and own["acceptance_rate"] == 1.0)
        out["full_acceptance_speedup"] = {"value": kept["speedup"], "goal": f">= {TARGET_SPEEDUP}x (D = {D})",
                                          "met": kept["speedup"] >= TARGET_SPEEDUP and kept_all,
                                          "forced_to": "plain decoding's text" if kept is full else "its own greedy text"}
    equal = rec.get("greedy_equal")
    if equal:
        out["greedy_equal"] = {"value": equal["mismatched"], "goal": "0 tokens differ", "met": equal["equal"]}
    rec["targets"] = out


def table(rec: dict) -> str:
    rows = [f"{'batch':>6}{'decode ms':>11}{'verify ms':>11}{'ratio':>8}"]
    for B, c in rec.get("step_cost", {}).items():
        rows.append(f"{B:>6}{fmt(c['decode_ms'], '.3f'):>11}{fmt(c['verify_ms'], '.3f'):>11}{fmt(c['ratio'], '.2f'):>8}")
        if "verify_profile" in c:
            d, v = c["decode_profile"], c["verify_profile"]
            rows.append(f"{'':>6}kernels: decode {fmt(d['kernels_per_call'], '.0f')} ({fmt(d['kernel_ms'], '.3f')} ms), "
                        f"verify {fmt(v['kernels_per_call'], '.0f')} ({fmt(v['kernel_ms'], '.3f')} ms); verify pays more "
                        "for: " + ", ".join(f"{r['name'][:40]} {r['extra_ms']:+.3f}"
                                            for r in c["verify_minus_decode_by_kernel"][:6]))
    for B, v in rec.get("verify_vs_decode", {}).items():
        rows.append(f"verify vs decode, batch {B}: row rel err median {fmt(v['median_rel_err'], '.2e')}, max "
                    f"{fmt(v['max_rel_err'], '.2e')}; argmax flips {v['argmax_flips']} of {v['rows']} at margins "
                    f"{[round(m, 4) for m in v['flip_margins']]} (median margin {fmt(v['median_margin'], '.3f')})")
        traced = v.get("eager_traced")
        if traced:
            rows.append(f"{'':>6}eager, op by op: {traced['rows_parted']} of {v['rows']} rows part from the decode "
                        f"step's bits; first at: {traced['first_partings']}")
    full = rec.get("full_acceptance")
    if full:
        rows.append(f"full acceptance: {fmt(full['spec']['tokens_per_s'])} tok/s against "
                    f"{fmt(full['plain']['tokens_per_s'])} plain ({fmt(full['speedup'], '.2f')}x), same tokens: "
                    f"{full['same_tokens']} (first difference at token "
                    f"{(full.get('difference') or {}).get('first_diff')}); "
                    f"{fmt(full.get('speedup_if_all_kept'), '.2f')}x if every step kept "
                    f"D + 1 tokens at the measured step costs; {fmt(full.get('kernel_floor_speedup'), '.2f')}x at "
                    f"the kernels' time alone")
        own = full.get("own_text")
        if own:
            rows.append(f"forced to its own greedy text: {fmt(own['tokens_per_s'])} tok/s ({fmt(own['speedup'], '.2f')}x), "
                        f"acceptance {fmt(own['acceptance_rate'], '.3f')}, the same tokens as its first run: "
                        f"{own['same_tokens_as_first']}")
        products = full.get("draft_products")
        if products:
            rows.append(f"the draft's graphs on torch's products against the fixed-order ones: "
                        f"{fmt(products['ratio_of_medians'], '.3f')}x tokens per second (medians of 3 runs each)")
        order = full.get("draft_order")
        if order:
            rows.append(f"draft step before the round's read against after it: "
                        f"{fmt(order['ratio_of_medians'], '.3f')}x tokens per second (medians of 3 runs each)")
    bound = rec.get("speedup_bound")  # step_cost's: also when full_acceptance is skipped
    if bound:
        rows.append(f"full acceptance's bound were the draft's layer free: {fmt(bound['speedup'], '.2f')}x = (D + 1) x "
                    f"decode kernels {fmt(bound['decode_kernel_ms'], '.3f')} ms / (verify kernels "
                    f"{fmt(bound['verify_kernel_ms'], '.3f')} + D x lm_head row {fmt(bound['lm_head_row_ms'], '.3f')} ms)")
    equal = rec.get("greedy_equal")
    if equal:
        rows.append(f"greedy with drafts: {equal['mismatched']} of {equal['tokens']} tokens differ; real draft "
                    f"acceptance {fmt(equal['acceptance_rate'], '.3f')}")
        ties = equal.get("ties")
        if ties and ties["first_diffs"]:
            margins = [round(d["plain_margin"], 4) for d in ties["first_diffs"]]
            delta = ties["matched_logprob_delta"]
            rows.append(f"  first differences at plain top-2 margins {margins} (median margin of all plain tokens "
                        f"{fmt(ties['median_plain_margin'], '.3f')}; worst rank "
                        f"{fmt(ties['worst_first_diff_rank'], '.3f')}); log-prob delta before them: median "
                        f"{fmt(delta['median'], '.2e')}, max {fmt(delta['max'], '.2e')}")
    return "\n".join(rows + target_rows(rec))


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--draft-tokens", type=int, default=3, help="D")
        p.add_argument("--batches", default=None, help="step_cost batch sizes, comma-separated")
        p.add_argument("--prompt-len", type=int, default=None)
        p.add_argument("--new-tokens", type=int, default=None, help="full_acceptance: tokens generated")
        p.add_argument("--prompts", type=int, default=None, help="greedy_equal: prompts")
        p.add_argument("--equal-tokens", type=int, default=None, help="greedy_equal: tokens per prompt")
        p.add_argument("--torch-sums", action="store_true",
                       help="with --batch-invariant: torch's own sums and means instead of the fixed-order row sums "
                            "(the same-call baseline of their cost; a verify row may then leave its decode step's bits)")

    return engine_script(argv, __doc__, "spec_bench", {"gpu": GPU_DEFAULTS, "dry": DRY_DEFAULTS}, add_arguments,
                         bench, table,
                         lambda a: f"{a.config or a.family + ' ' + a.size}: D = {a.draft_tokens}")


if __name__ == "__main__":
    main()
