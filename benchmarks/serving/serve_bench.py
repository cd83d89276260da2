"""Serving benchmark: `hgc serve` under load at several concurrencies, over its OpenAI HTTP surface.

On the GPU machine (the lead's command; carry the wheels of fastapi, uvicorn, httpx and their
dependencies with hgc's):

    hgc init-model --family qwen3_next --size bench --seed 0 -o /tmp/ckpt
    hgc compile /tmp/ckpt --target cuda --dtype bfloat16 -o /tmp/bench
    python3 benchmarks/serving/serve_bench.py --artifact /tmp/bench --device cuda --out $OUT
    # the same for an MLA family: --family kimi_linear

On a CPU, a few seconds (what tests/server/test_server.py runs):

    python benchmarks/serving/serve_bench.py --dry-run --artifact artifacts/tiny --out /tmp/serve_bench
    python benchmarks/serving/serve_bench.py --dry-run --url http://127.0.0.1:8000 --model tiny   # a running server
    python benchmarks/serving/serve_bench.py --dry-run --artifact artifacts/tiny --offline   # and the engine alone

1. The server: started here from --artifact (`python -m hgc serve`, its --device and sizing
   flags, `--port 0`) and stopped at the end, or one already running at --url.
2. The load: a fixed mix of (prompt tokens, output tokens) pairs, cycled; prompts are seeded
   random token ids (no tokenizer involved), outputs exactly that long (ignore_eos). Per
   concurrency C: C workers, each sending its next request as soon as its last one ends (a
   closed loop), until --requests-per-worker x C requests have ended. One warm-up request first.
3. Each request streams (`stream: true`, usage included): its time to first token (TTFT: from
   sending to the first chunk that carries a token) and the gaps between its later tokens
   (inter-token latency, ITL) are recorded.
4. Per level (with the GPU's busy fraction over its steady part where `nvidia-smi` samples it,
   `GpuBusy`): TTFT and ITL median and p99 (ITL pooled over every token of every request, as
   vLLM's benchmark pools it: the tokens of one chunk after its first count as 0 s gaps, so where a
   server sends several tokens per chunk the ITL median says little), TPOT median and p99 (per
   request, the time from its first token to its last over the tokens after the first: the pace
   of decoding whatever the chunking), tokens per chunk, the server's step, preemption and CPU
   counters over the level and its mean open, queued and running requests (/metrics, sampled
   every 0.25 s), the benchmark's own CPU share (near 1 it sets the pace: each worker has a
   client and connection of its own, see run_level), output tokens per second and requests per second over the level's
   wall time, and the errors. The table is printed; --out writes serve_bench.json with the
   per-request records, the command line, the date and the server's /v1/models card.
5. With --offline, once the server has stopped: benchmarks/serving/offline_bench.py in a process of
   its own on the same artifact, levels and prompts (level_requests), straight to the engine;
   per level its output tok/s with as many requests in flight and served tok/s over it (what
   HTTP, the tokenizer-free streaming path and the engine loop's thread cost). Its JSON goes to
   OUT/offline/, its stages' status and closed-loop runs into serve_bench.json.

It does not compare engines or check tokens (tests/server/test_server.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_common import fmt  # noqa: E402
from testkit.helpers import ServerProcess  # noqa: E402

GPU = dict(concurrency=(1, 8, 32, 128), mix=((128, 128), (512, 64), (64, 256), (1024, 32)), requests_per_worker=4)
DRY = dict(concurrency=(1, 4), mix=((8, 6), (24, 3), (4, 10)), requests_per_worker=2)
FIRST_TOKEN_ID = 16  # prompt ids start above the special tokens of hgc's tokenizers (and of most others)
WARM_UP = (list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 8)), 4)  # (prompt, output tokens) before the levels


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Send one streamed completion; its TTFT, token times and token count (or its error).

    The stream is read as server-sent events with the standard library's JSON parser, as vLLM's
    serving benchmark reads it, not through the OpenAI client: building that client's typed chunk
    objects costs about 0.1 ms a chunk, so at several thousand chunks a second one client process
    would be the limit being measured. (tests/server/ check the stream through the official client.)"""
    start = time.perf_counter()
    times, tokens, usage = [], 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    n = len(choice.get("token_ids") or ())  # hgc's extension: the ids of the chunk
                    if n:
                        times += [time.perf_counter()] * n
                        tokens += n
    except Exception as e:  # noqa: BLE001 - counted per level, the run goes on
        return {"error": repr(e), "prompt_tokens": len(prompt), "max_tokens": max_tokens}
    end = time.perf_counter()
    return {"prompt_tokens": len(prompt), "max_tokens": max_tokens, "output_tokens": tokens,
            "usage_completion_tokens": usage["completion_tokens"] if usage else None,
            "ttft_s": times[0] - start if times else None, "latency_s": end - start,
            "itl_s": [b - a for a, b in zip(times, times[1:])], "chunks": len(set(times)),
            # time per output token after the first: the pace of decoding whatever the chunking
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}


def parse_mix(text: str) -> tuple[tuple[int, int], ...]:
    """--mix: comma-separated prompt:output pairs of positive token counts, e.g. 128:128,512:64."""
    try:
        mix = tuple(tuple(int(x) for x in pair.split(":")) for pair in text.split(","))
    except ValueError:
        mix = ()
    if not mix or any(len(pair) != 2 or min(pair) < 1 for pair in mix):
        raise argparse.ArgumentTypeError(f"{text!r}: expected prompt:output pairs of positive token counts, "
                                         f"e.g. 128:128,512:64")
    return mix


def level_requests(mix, concurrency: int, requests_per_worker: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """The (prompt ids, output tokens) of one level, in sending order: the mix cycled over
    requests_per_worker x concurrency requests, prompts seeded random ids (seed + concurrency),
    the same for every engine a level is run on (benchmarks/serving/offline_bench.py's too)."""
    g = random.Random(seed + concurrency)
    jobs = [mix[i % len(mix)] for i in range(requests_per_worker * concurrency)]
    return [([g.randrange(FIRST_TOKEN_ID, vocab) for _ in range(p)], o) for p, o in jobs]


def sizing(concurrency, mix) -> dict:
    """The engine's size for a run: a slot per worker of the highest concurrency, and room for the
    longest request of the mix (at least 256 tokens)."""
    return {"slots": max(concurrency), "max_model_len": max(256, max(p + o for p, o in mix))}


COUNTERS = ("hgc_engine_phase_steps_total", "hgc_engine_phase_seconds_total", "hgc_generation_tokens_total",
            "hgc_prefill_tokens_total", "hgc_preemptions_total", "hgc_kernels_built_serving_total",
            "hgc_engine_schedule_steps_total", "hgc_server_cpu_seconds_total", "hgc_engine_core_cpu_seconds_total")


GAUGES = ("hgc_open_requests", "hgc_queue_depth", "hgc_running_requests")


async def sample_gauges(client, samples: list, every_s: float = 0.25) -> None:
    """Until cancelled: (time, {gauge: value}) of GAUGES every every_s, where a level's requests
    are: open on the server, queued in the engine, or running. Requests the client counts in
    flight and the server does not are still with the client or on their way."""
    while True:
        response = await client.get("/metrics")
        values = {}
        for line in response.text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in GAUGES:
                values[name[4:]] = float(value)
        samples.append((time.perf_counter(), values))
        await asyncio.sleep(every_s)


def gauge_means(samples: list, start: float, end: float) -> dict[str, float]:
    """Each gauge's mean over the samples taken between start and end."""
    inside = [values for t, values in samples if start <= t <= end]
    return {key: sum(v.get(key, 0.0) for v in inside) / len(inside) for key in inside[0]} if inside else {}


async def server_counters(client) -> dict[str, float]:
    """The server's counters of COUNTERS from /metrics (Prometheus text), one key per labelled
    sample: what kind of steps a level made, what it preempted, what it built while serving."""
    response = await client.get("/metrics")
    counts = {}
    for line in response.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(COUNTERS):
            counts[name] = float(value)
    return counts


class GpuBusy:
    """The GPU's busy fraction as `nvidia-smi` samples it (utilization.gpu: the share of each 100 ms
    in which a kernel ran) while the levels run, read on a thread; none where there is no nvidia-smi
    (the CPU) or it fails. `steady(start, end)`: the mean over a level's steady part, its first and
    last tenth left out (the ramp up and the tail of its last requests)."""

    def __init__(self):
        import shutil
        import threading

        self.samples: list[tuple[float, float]] = []
        self.process = None
        if shutil.which("nvidia-smi") is None:
            return
        self.process = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                         "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], "-lms", "100"],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip()) / 100))
            except ValueError:
                continue  # "[N/A]" or a header: not a sample

    def steady(self, start: float, end: float) -> float | None:
        lo, hi = start + (end - start) / 10, end - (end - start) / 10
        values = [v for t, v in self.samples if lo <= t <= hi]
        return sum(values) / len(values) if values else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()


async def run_level(url: str, model: str, concurrency: int, requests: list[tuple[list[int], int]]) -> dict:
    """The closed loop of one level. Each worker has a client of its own with one connection:
    httpx's pool looks at each of its connections for every request it sends and every response
    it closes, so one pool of 128 connections spent most of a core there, a limit of the
    benchmark, not of the server (it was seen making requests wait seconds to be sent)."""
    import ssl

    import httpx

    queue = list(reversed(requests))
    records = []
    tls = ssl.create_default_context()  # once: each client would read the CA store again (about 20 ms)
    clients = [httpx.AsyncClient(base_url=url, timeout=600, verify=tls,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
               for _ in range(concurrency)]

    async def worker(client):
        async with client:
            while queue:
                prompt, max_tokens = queue.pop()
                records.append(await one_request(client, model, prompt, max_tokens))

    cpu = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in clients))
    end = time.perf_counter()
    wall = end - start
    cpu = time.process_time() - cpu
    done = [r for r in records if "error" not in r]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    itl = [gap for r in done for gap in r["itl_s"]]
    tpot = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
    out_tokens = sum(r["output_tokens"] for r in done)
    return {"concurrency": concurrency, "requests": len(records), "errors": len(records) - len(done),
            "start_s": start, "end_s": end, "wall_s": wall, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "requests_per_s": len(done) / wall,
            # the benchmark's own process: near 1 it, not the server, sets the pace
            "client_cpu_share": cpu / wall,
            "ttft_median_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_median_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "tpot_median_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "tokens_per_chunk": out_tokens / max(1, sum(r["chunks"] for r in done)),
            "records": records}


def fmt_gauges(means: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.1f}" for key, value in means.items()) or "-"


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def table(levels: list[dict]) -> str:
    """The levels' table; with --offline, two more columns: the offline figure at the same number
    in flight and served over offline."""
    offline = any("served_over_offline" in lv for lv in levels)
    head = ("| concurrency | requests | errors | TTFT median ms | TTFT p99 ms | ITL median ms | ITL p99 ms "
            "| TPOT median ms | TPOT p99 ms | tokens/chunk | out tok/s | req/s | GPU busy |"
            + (" offline tok/s | served/offline |" if offline else ""))
    rows = [head, "|" + "---|" * (15 if offline else 13)]
    for lv in levels:
        rows.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {fmt_ms(lv['ttft_median_s'])} | "
                    f"{fmt_ms(lv['ttft_p99_s'])} | {fmt_ms(lv['itl_median_s'])} | {fmt_ms(lv['itl_p99_s'])} | "
                    f"{fmt_ms(lv.get('tpot_median_s'))} | {fmt_ms(lv.get('tpot_p99_s'))} | "
                    f"{fmt(lv.get('tokens_per_chunk'), '.2f', '-')} | "
                    f"{lv['output_tokens_per_s']:.1f} | {lv['requests_per_s']:.2f} | "
                    f"{'-' if lv.get('gpu_busy') is None else format(lv['gpu_busy'], '.0%')} |"
                    + (f" {fmt(lv['offline_output_tokens_per_s'], '.1f', '-')} | {fmt(lv['served_over_offline'], '.2f', '-')} |"
                       if offline else ""))
    return "\n".join(rows)


VALUED_FLAGS = ("--token-budget", "--decodes-apart-from")


def engine_flags(serve_args: str) -> list[str]:
    """The flags of --serve-args that offline_bench.py takes too, so the engine alone runs as the
    server's does: the overlapped schedule on or off, decodes apart, the token budget per step."""
    words, flags = serve_args.split(), []
    for i, word in enumerate(words):
        if word in ("--overlap-schedule", "--no-overlap-schedule") or word.startswith(tuple(f + "=" for f in VALUED_FLAGS)):
            flags.append(word)
        elif word in VALUED_FLAGS and i + 1 < len(words):
            flags += [word, words[i + 1]]
    return flags


def offline(args, concurrency, mix, per_worker: int, out: Path) -> dict:
    """benchmarks/serving/offline_bench.py on the same artifact, levels and prompts, in a process of
    its own (started after the server has stopped, so the two never share the device): its
    stages' status and its closed-loop runs by concurrency. A server run with --overlap-schedule,
    --no-overlap-schedule or --token-budget (in --serve-args) is compared with an engine run the same way."""
    script = ROOT / "benchmarks" / "serving" / "offline_bench.py"
    argv = [sys.executable, str(script), "--artifact", args.artifact, "--device", args.device, "--out", str(out),
            "--concurrency", ",".join(map(str, concurrency)), "--mix", ",".join(f"{p}:{o}" for p, o in mix),
            "--iters", str(per_worker), "--seed", str(args.seed), "--no-serve-vs-run",
            *(["--dry-run"] if args.dry_run else []),
            *engine_flags(args.serve_args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(argv, cwd=ROOT, env=env, check=True)
    rec = json.loads((out / "offline_bench.json").read_text())
    return {"command": " ".join(argv[1:]), "stages": {name: s["status"] for name, s in rec["stages"].items()},
            "engine": rec.get("engine"), "runs": rec.get("runs", {})}


def add_offline(levels: list[dict], report: dict) -> None:
    """Per level: the offline output tok/s with as many in flight, and served over it (None where
    the offline run did not finish)."""
    for lv in levels:
        run = report["runs"].get(f"closed_loop_c{lv['concurrency']}")
        lv["offline_output_tokens_per_s"] = run["output_tokens_per_s"] if run else None
        lv["served_over_offline"] = lv["output_tokens_per_s"] / run["output_tokens_per_s"] if run else None


async def bench(url: str, model: str | None, concurrency, mix, requests_per_worker: int, seed: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # the model card and /metrics
        models = await client.get("/v1/models")
        models.raise_for_status()
        card = models.json()["data"][0]
        model = model or card["id"]
        vocab = int(card.get("vocab_size") or 1000)
        longest = max(p + o for p, o in mix)
        if card.get("max_model_len") and longest > card["max_model_len"]:
            raise SystemExit(f"serve_bench: the mix needs {longest} tokens per request; the server takes "
                             f"{card['max_model_len']} (--max-model-len)")
        warm = await one_request(client, model, *WARM_UP)
        if "error" in warm:
            raise SystemExit(f"serve_bench: the warm-up request failed: {warm['error']}")
        levels, busy = [], GpuBusy()
        try:
            for c in concurrency:
                before, samples = await server_counters(client), []
                sampler = asyncio.ensure_future(sample_gauges(client, samples))
                try:
                    level = await run_level(url, model, c, level_requests(mix, c, requests_per_worker, vocab, seed))
                finally:
                    sampler.cancel()
                level["gpu_busy"] = busy.steady(level["start_s"], level["end_s"])
                after = await server_counters(client)
                level["server_counters"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
                level["server_gauges_mean"] = gauge_means(samples, level["start_s"], level["end_s"])
                print(f"concurrency {c}: {level['requests']} requests in {level['wall_s']:.1f} s, "
                      f"{level['output_tokens_per_s']:.1f} output tok/s; client CPU {level['client_cpu_share']:.0%}; "
                      f"mean on the server: {fmt_gauges(level['server_gauges_mean'])}", file=sys.stderr)
                levels.append(level)
        finally:
            busy.stop()
    return {"model_card": card, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--artifact", help="start `hgc serve` on this artifact (stopped at the end)")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--dry-run", action="store_true", help=f"CPU size: concurrency {DRY['concurrency']}, mix {DRY['mix']}")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help=f"default {GPU['concurrency']}")
    p.add_argument("--mix", type=parse_mix, default=None,
                   help="prompt:output pairs, e.g. 128:128,512:64 (default: the GPU or dry mix)")
    p.add_argument("--requests-per-worker", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="with --artifact: hgc serve --device")
    p.add_argument("--serve-args", default="", help="with --artifact: more hgc serve flags, e.g. '--slots 256'")
    p.add_argument("--out", default=None, help="folder for serve_bench.json (and offline/ with --offline)")
    p.add_argument("--offline", action="store_true",
                   help="with --artifact: then benchmarks/serving/offline_bench.py on it, the same levels and prompts "
                        "with no HTTP, and per level served tok/s over offline tok/s at as many in flight (the server's "
                        "engine knobs at hgc serve's defaults: --serve-args that change them make unlike engines)")
    args = p.parse_args(argv)
    if args.offline and not args.artifact:
        p.error("--offline: needs --artifact (the offline run loads it)")
    preset = DRY if args.dry_run else GPU
    concurrency = tuple(args.concurrency or preset["concurrency"])
    mix = args.mix or preset["mix"]
    per_worker = args.requests_per_worker or preset["requests_per_worker"]

    server = None
    if args.artifact:
        size = sizing(concurrency, mix)
        flags = ["--device", args.device, "--slots", str(size["slots"]), "--max-model-len", str(size["max_model_len"]),
                 *args.serve_args.split()]
        server = ServerProcess([args.artifact, *flags]).wait_ready(timeout=1800)
    url = args.url or server.url
    try:
        result = asyncio.run(bench(url, args.model, concurrency, mix, per_worker, args.seed))
    finally:
        if server is not None:
            server.stop()
    if args.offline:
        with tempfile.TemporaryDirectory() as scratch:
            result["offline"] = offline(args, concurrency, mix, per_worker,
                                        Path(args.out) / "offline" if args.out else Path(scratch))
        add_offline(result["levels"], result["offline"])
    result.update(command=" ".join(sys.argv if argv is None else ["serve_bench.py", *argv]),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), dry_run=args.dry_run, mix=mix,
                  requests_per_worker=per_worker)
    print(table(result["levels"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_bench.json").write_text(json.dumps(result, indent=1))
    offline_ok = all(status == "ok" for status in result.get("offline", {}).get("stages", {}).values())
    return 0 if offline_ok and all(lv["errors"] == 0 for lv in result["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
