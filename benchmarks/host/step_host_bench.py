"""Host time of an engine step outside the model's forward, and of the engine core's per-token message path.

    python benchmarks/host/step_host_bench.py --dry-run --out /tmp/shb                  # CPU, tiny qwen3_next
    python benchmarks/host/step_host_bench.py --dry-run --out /tmp/shb --baseline-ref main   # before/after
    python benchmarks/host/step_host_bench.py --out $OUT --device cuda --artifact /tmp/bench  # GPU machine

The engine is the one `hgc serve` builds (runtime/assembly.engine_for_artifact, prefix cache on,
--token-budget tokens a step), over an EagerRunner: every step schedules, lays out (build_step),
plans through the backends' per-step hooks, runs the forward, draws and records its tokens, checks
stops, keeps its statistics and hands back its outputs, all for real. Only the forward differs:

- `--forward free` (default): the program's forward is replaced by one that costs next to nothing
  (the next token is a fixed function of the fed one, as a one-hot logits row), so the step's own
  host work is all that is left to time and to profile;
- `--forward real`: the artifact's forward runs and its time is taken out of each step's (on cuda
  up to its device work's end: the forward synchronises, so device time is not counted as host's).

Either way a step's host time is its wall time minus the forward's, per step.

1. artifact: --artifact, or `hgc init-model` and `hgc compile` (bench_common.compiled_artifact).
2. decode_bB, per --batches B: B requests of --context prompt tokens, prefilled, then --steps steps
   of B decodes timed one by one (median and mean host ms per step), then a cProfile of
   --profile-steps more: the top 25 functions by cumulative and by own time.
3. mixed: --mixed-in-flight requests in flight (prompts of --mixed-prompt tokens, --mixed-output
   new tokens), each finished one replaced before the next step, so steps carry prompt chunks
   beside decodes up to the token budget; host ms of the steps that are mixed (and of all), and
   their cProfile.
4. messages: the engine core's per-step message path over the outputs of a B = max(--batches) decode
   step, per token: the core packs a step's outputs (runtime/core/messages.py, `_Core.step`'s
   work), the server's receiving thread unpacks them and hands each to its RequestHandle on an
   asyncio loop (runtime/core/client.py `_dispatch`), and the server turns each token into text
   and an SSE chunk (runtime/server/generation.py's IncrementalDecoder, a chat chunk, `sse_event`).
5. baseline (--baseline-ref GITREF): the same measurement, in a process of its own, over the code of
   GITREF (`git archive` into OUT/baseline-src), so before and after are measured in one call on the
   same machine; the table shows both and their ratio.

JSON to OUT/step_host_bench.json after each stage, a table last. It does not check tokens (the
engine's tests do); with a free forward they are not the model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # code_root
from code_root import CHECKOUT as HERE, code_root, unpacked  # noqa: E402

CODE = code_root(sys.argv[1:])
sys.path.insert(0, str(HERE / "benchmarks"))  # bench_common: this checkout's
sys.path.insert(0, str(CODE))  # the runtime measured: first on the path

from bench_common import Stages, compiled_artifact, engine_script, fmt, host_profile, host_speed_ms  # noqa: E402
import torch  # noqa: E402

TOP = 25
BLOCKS = 5
BASELINE_NAME = "step_host_bench"


def build_engine(art, slots: int, max_model_len: int, token_budget: int):
    from runtime.assembly import EngineOptions, engine_for_artifact

    options = EngineOptions(slots=slots, token_budget=token_budget, max_model_len=max_model_len)
    return engine_for_artifact(art, options, max_model_len, device=art.device, graphs=False)


class TimedForward:
    """The runner's forward, timed (`seconds` accumulates); `free`: replaced by one that costs next
    to nothing: logits are one-hot rows of (fed token * 7 + 3) mod V, so greedy tokens are a fixed
    function of the fed ones and never the model's."""

    def __init__(self, runner, vocab: int, free: bool):
        self.real, self.vocab, self.free = runner.forward, vocab, free
        self.seconds = self.cpu_seconds = 0.0  # wall, and this thread's CPU
        runner.forward = self

    def __call__(self, input_ids, positions, *rest):
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.free:
            rows = rest[-1]
            out = torch.nn.functional.one_hot((input_ids[rows] * 7 + 3) % self.vocab, self.vocab).float()
        else:
            out = self.real(input_ids, positions, *rest)
            if input_ids.is_cuda:  # its device time is the forward's too, not the host's
                torch.cuda.synchronize(input_ids.device)
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return out


def host_ms(fn, forward: TimedForward) -> tuple[float, float]:
    """fn()'s milliseconds less the forward's inside it: (wall, this thread's CPU). The CPU time is
    what a shared machine's other work does not inflate (torch runs on this thread: one thread is
    set); the wall time also holds the host's waits for the device."""
    t0, c0, f0, fc0 = time.perf_counter(), time.thread_time(), forward.seconds, forward.cpu_seconds
    fn()
    return ((time.perf_counter() - t0 - (forward.seconds - f0)) * 1e3,
            (time.thread_time() - c0 - (forward.cpu_seconds - fc0)) * 1e3)


def timed_steps(engine, forward: TimedForward, steps: int) -> list[tuple[float, float]]:
    """(wall, CPU) host milliseconds of each of `steps` steps."""
    return [host_ms(engine.step, forward) for _ in range(steps)]


def _best(values: list[float]) -> float:
    """The lowest median of BLOCKS runs of consecutive steps: a shared machine's load comes and
    goes within a case, and the quietest stretch's median is the steps' own cost."""
    size = -(-len(values) // BLOCKS)
    return min(statistics.median(values[i:i + size]) for i in range(0, len(values), size))


def summary(host: list[tuple[float, float]]) -> dict:
    """host_ms_*: wall; host_cpu_ms_*: the thread's CPU time (the table compares both bests)."""
    if not host:
        return {"steps": 0, **{f"host{kind}_ms_{stat}": None for kind in ("", "_cpu")
                               for stat in ("best", "median", "mean")}}
    out = {"steps": len(host)}
    for kind, values in (("", [w for w, _ in host]), ("_cpu", [c for _, c in host])):
        out.update({f"host{kind}_ms_best": _best(values), f"host{kind}_ms_median": statistics.median(values),
                    f"host{kind}_ms_mean": statistics.fmean(values)})
    return out


def decode_case(art, args, batch: int, vocab: int) -> dict:
    """Step 2 of the module docstring for B = batch."""
    from runtime.engine.sampling import SamplingParams

    # While the last request prefills, the first ones decode: room for those tokens too.
    total = args.context + batch * args.context // args.token_budget + args.steps + args.profile_steps + 64
    engine = build_engine(art, batch, total, args.token_budget)
    forward = TimedForward(engine.runner, vocab, args.forward == "free")
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(1, vocab, (args.context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=total - args.context))
    while engine.scheduler.waiting or any(not req.decoding for req in engine.scheduler.running):
        engine.step()
    timed_steps(engine, forward, 5)  # warm-up
    speed = host_speed_ms()
    before = forward.seconds
    host = timed_steps(engine, forward, args.steps)
    forward_ms = (forward.seconds - before) * 1e3 / args.steps
    profile = host_profile(engine.step, iters=args.profile_steps, top=TOP) if args.profile_steps else None
    assert engine.numbers.recent[-1].decode_tokens == batch, "a decode case's steps are all decodes"
    return {"batch": batch, "context": args.context, **summary(host), "host_speed_ms": speed,
            "forward_ms_per_step": forward_ms, "profile": profile, "_engine": engine}


def mixed_case(art, args, vocab: int) -> dict:
    """Step 3 of the module docstring: a closed loop of requests, the mixed steps timed."""
    from runtime.engine.sampling import SamplingParams

    n, plen, out = args.mixed_in_flight, args.mixed_prompt, args.mixed_output
    engine = build_engine(art, n, plen + out + 16, args.token_budget)
    forward = TimedForward(engine.runner, vocab, args.forward == "free")
    g = torch.Generator().manual_seed(7)

    def add():
        engine.add_request(torch.randint(1, vocab, (plen,), generator=g).tolist(), SamplingParams(max_new_tokens=out))

    def step_and_refill():
        for o in engine.step():
            if o.finished:
                engine.pop_result(o.request_id)
                add()

    # Requests enter a few a step, so their ends spread out and later steps mix chunks and decodes.
    for _ in range(n):
        add()
    for _ in range(2 * (out + plen * n // args.token_budget)):
        step_and_refill()
    records, host, all_host = [], [], []
    speed = host_speed_ms()
    for _ in range(args.steps):
        ms = host_ms(step_and_refill, forward)
        rec = engine.numbers.recent[-1]
        all_host.append(ms)
        if rec.prefill_tokens and rec.decode_tokens:
            host.append(ms)
            records.append((rec.prefill_tokens, rec.decode_tokens))
    profile = host_profile(step_and_refill, iters=args.profile_steps, top=TOP) if args.profile_steps else None
    return {"in_flight": n, "prompt": plen, "output": out, **summary(host), "all_steps": summary(all_host),
            "mean_prompt_tokens": statistics.fmean(p for p, _ in records) if records else None,
            "mean_decodes": statistics.fmean(d for _, d in records) if records else None,
            "host_speed_ms": speed, "profile": profile}


def message_path(art_dir: Path, engine, steps: int) -> dict:
    """Step 4 of the module docstring: microseconds per token of each part, over `steps` steps'
    outputs, in the CPU time of the thread that does the part."""
    from runtime.artifact.tokenizer import IncrementalDecoder, TextTokenizer
    from runtime.core import messages
    from runtime.core.client import EngineCoreClient
    from runtime.engine.loop import RequestHandle
    from runtime.server.protocol import chat_chunk
    from runtime.server.sse import sse_event

    step_outputs = [engine.step() for _ in range(steps)]
    speed = host_speed_ms()
    tokens = sum(len(outs) for outs in step_outputs)

    t0 = time.thread_time()  # the core: _Core.step's work after engine.step()
    packed = []
    for outs in step_outputs:
        wire = [messages.output_to_wire(out, engine.cached_tokens(out.request_id), None) for out in outs]
        packed.append(messages.pack(["step", wire]))
    core_s = time.thread_time() - t0

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = EngineCoreClient(None, None, None, None, {})  # its receiving side only: no process, no sockets
    for out in step_outputs[0]:
        client._handles[out.request_id] = RequestHandle(out.request_id, client, loop)
    t0 = time.thread_time()  # the server's receiving thread: unpack, hand over
    for data in packed:
        client._dispatch(messages.unpack(data))
    client_s = time.thread_time() - t0
    loop.call_soon_threadsafe(loop.stop)
    thread.join()

    tokenizer = TextTokenizer.from_dir(art_dir)
    decoders = {out.request_id: IncrementalDecoder(tokenizer, [1, 2, 3]) for out in step_outputs[0]}
    t0 = time.thread_time()  # the server's event loop: text and SSE framing of each token
    for outs in step_outputs:
        for out in outs:
            text = decoders[out.request_id].push(out.token)
            sse_event(chat_chunk("chatcmpl-0", "m", 0, 0, {"content": text}, [out.token], None))
    server_s = time.thread_time() - t0
    bytes_per_token = sum(map(len, packed)) / tokens
    return {"tokens": tokens, "steps": steps, "bytes_per_token": bytes_per_token,
            "core_pack_us_per_token": 1e6 * core_s / tokens, "client_hand_over_us_per_token": 1e6 * client_s / tokens,
            "server_text_sse_us_per_token": 1e6 * server_s / tokens, "host_speed_ms": speed}


def baseline(args, argv: list[str], out: Path) -> dict:
    """Step 5: this script over GITREF's code, in a process of its own, with this run's `argv`; its JSON record."""
    src = unpacked(args.baseline_ref, out / "baseline-src")
    argv = _drop_flag(_drop_flag(_drop_flag(_drop_flag(argv, "--baseline-ref"), "--out"), "--code-root"), "--work")
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, __file__, *argv, "--out", str(out / "baseline"), "--work", args.work,
                    "--code-root", str(src)], env=env, check=True)
    return json.loads((out / "baseline" / f"{BASELINE_NAME}.json").read_text())


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (as `--flag value` or `--flag=value`)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            kept.append(a)
    return kept


def bench(args, rec: dict, save, argv: list[str]) -> None:
    from runtime.artifact.loader import load_artifact

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host path is one thread; a tiny forward only loses to more
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    state: dict = {}
    rec.update(code=str(CODE), decode={}, mixed=None, messages=None)
    try:
        def artifact():
            state["art_dir"] = compiled_artifact(args)
            state["art"] = load_artifact(state["art_dir"], device=args.device)
            state["vocab"] = int(state["art"].manifest["model"]["vocab_size"])

        def decode(batch: int):
            result = decode_case(state["art"], args, batch, state["vocab"])
            state["engine"] = result.pop("_engine")
            rec["decode"][str(batch)] = result

        stages("artifact", artifact)
        for batch in args.batches:
            stages(f"decode_b{batch}", decode, batch, needs=("artifact",))
        stages("mixed", lambda: rec.update(mixed=mixed_case(state["art"], args, state["vocab"])), needs=("artifact",))
        last = f"decode_b{args.batches[-1]}"
        stages("messages", lambda: rec.update(messages=message_path(state["art_dir"], state["engine"], 20)),
               needs=(last,))
        if args.baseline_ref:
            stages("baseline", lambda: rec.update(baseline=baseline(args, argv, Path(args.out))))
    finally:
        torch.set_num_threads(threads)


def _row(name: str, now: dict | None, before: dict | None, key: str = "host_ms_best", per_speed: bool = True) -> str:
    """One case: baseline, now, their ratio, and the ratio at equal host speed (each run's time over
    its `host_speed_ms`, taken beside it: a shared machine's speed drifts between the two runs)."""
    a = now.get(key) if now else None
    b = before.get(key) if before else None
    ratio = b / a if a and b else None
    speeds = (before or {}).get("host_speed_ms"), (now or {}).get("host_speed_ms")
    same_speed = ratio * speeds[1] / speeds[0] if per_speed and ratio and all(speeds) else None
    return (f"| {name} | {fmt(b, '.3f')} | {fmt(a, '.3f')} | {fmt(ratio, '.2f') + ('x' if ratio else '')} | "
            f"{fmt(same_speed, '.2f') + ('x' if same_speed else '')} |")


def table(rec: dict) -> str:
    base = rec.get("baseline") or {}
    rows = [f"code: {rec.get('code')}" + (f"; baseline: {base.get('code')}" if base else "")]
    for key, what in (("host_ms_best", "wall"), ("host_cpu_ms_best", "the thread's CPU")):
        rows += [f"| host ms per step, {what} (forward excluded; best block median) | baseline | now | "
                 f"baseline / now | at equal host speed |", "|---|---|---|---|---|"]
        for batch, case in rec.get("decode", {}).items():
            rows.append(_row(f"decode, B = {batch}", case, base.get("decode", {}).get(batch), key))
        if rec.get("mixed"):
            m = rec["mixed"]
            rows.append(_row(f"mixed ({fmt(m['mean_prompt_tokens'], '.0f')} prompt + {fmt(m['mean_decodes'], '.0f')} "
                             f"decode tokens)", m, base.get("mixed"), key))
    msg, base_msg = rec.get("messages"), base.get("messages")
    if msg:
        rows += ["| message path, us per token | baseline | now | baseline / now | at equal host speed |",
                 "|---|---|---|---|---|"]
        for key in ("core_pack_us_per_token", "client_hand_over_us_per_token", "server_text_sse_us_per_token",
                    "bytes_per_token"):
            rows.append(_row(key, msg, base_msg, key, per_speed=key != "bytes_per_token"))
    return "\n".join(rows)


def batch_list(text: str) -> tuple[int, ...]:
    """--batches: comma-separated positive request counts, e.g. 1,32,128."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: expected comma-separated positive integers, e.g. 1,32,128")
    return values


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--device", default=None, help="the device to run the artifact on (default: its own)")
        p.add_argument("--batches", type=batch_list, default=(1, 32, 128), help="decoding requests per case")
        p.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
        p.add_argument("--steps", type=int, default=None, help="timed steps per case (default 200, dry 100)")
        p.add_argument("--profile-steps", type=int, default=None, help="steps under cProfile per case (0: none)")
        p.add_argument("--token-budget", type=int, default=512, help="tokens per engine step (hgc serve's default)")
        p.add_argument("--mixed-in-flight", type=int, default=128)
        p.add_argument("--mixed-prompt", type=int, default=256)
        p.add_argument("--mixed-output", type=int, default=32)
        p.add_argument("--forward", choices=("free", "real"), default="free",
                       help="free: a forward that costs next to nothing; real: the artifact's, its time taken out")
        p.add_argument("--baseline-ref", default=None, help="also measure GITREF's code, in a process of its own")
        p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # read before the imports

    defaults = {"gpu": dict(family="qwen3_next", size="bench", steps=200, profile_steps=50),
                "dry": dict(family="qwen3_next", size="tiny", steps=100, profile_steps=30)}
    argv = list(sys.argv[1:] if argv is None else argv)
    return engine_script(argv, __doc__, BASELINE_NAME, defaults, add_arguments,
                         lambda args, rec, save: bench(args, rec, save, argv), table,
                         lambda a: f"step host time: {a.artifact or f'{a.family} {a.size}'}, batches {a.batches}, "
                                   f"forward {a.forward}")


if __name__ == "__main__":
    main()
