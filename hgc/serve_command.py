"""`hgc serve ARTIFACT`: load a compiled artifact and serve it over HTTP until SIGTERM.

    hgc serve artifacts/tiny --host 127.0.0.1 --port 8000 --slots 64 --token-budget 512
    python -m hgc serve artifacts/tiny --port 0             # the same, without the hgc entry point

1. `add_serve_arguments(subparsers)` registers the command (hgc/__init__.py calls it);
   `cmd_serve(args)` starts the engine core, a process of its own that loads the model
   (runtime/assembly.py) and steps it (runtime/core/; the same command with `--engine-core`),
   and calls `serve` with its client. `--engine-in-process` and `--tp N` load the model in this
   process (each rank) instead. A refusal of the core's is this process's one line and status.
2. The socket is bound before the model loads (`bind_socket`: a port in use or an address this
   machine does not have is refused at once, exit 2, naming --host/--port; `--port 0` takes any
   free port). `serve(served, options, sock)` prints one "listening" line on stderr once uvicorn
   accepts connections on it, and runs until SIGTERM or SIGINT.
3. SIGTERM: answer new requests 503 with Retry-After while in-flight ones finish, for up to
   --shutdown-timeout seconds (cancelling them shortly before), then stop listening, stop the
   engine, exit 0. uvicorn stops listening at once and re-raises the signal after its shutdown by
   default (new clients refused, exit status 143); `_Server` drains first and exits cleanly.
4. After a clean shutdown the process ends at once (`_end_process`): streams flushed, logging
   shut down, then os._exit. The interpreter's teardown would add seconds of garbage collection
   over torch's heap to a shutdown meant to be bounded, and, where objects of triton's nanobind
   bindings are still alive then (torch imports triton), some 30 lines of nanobind leak reports.
   Freezing the heap (gc.freeze) skipped the collections but made the reports certain.

Errors a user can fix (a bad artifact, bad flags, a budget too small) print one line and return 2.
The flag types here (`int_at_least`, `float_in`, `token_ids`, `device_arg`) check each value as
argparse reads it, so a bad value is refused naming its flag before anything loads; `hgc run`
shares them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import traceback
from typing import NoReturn

__all__ = ["add_serve_arguments", "add_prefix_cache_arguments", "add_overlap_argument", "schedule_options",
           "add_speculative_argument",
           "prefix_cache_options",
           "add_compiled_arguments", "compiled_options", "add_tp_arguments", "start_ranks", "cmd_serve", "serve",
           "bind_socket", "int_at_least", "host_arg", "SEED_LIMIT", "PORT_LIMIT", "float_in", "token_ids", "device_arg", "device_problem", "DEFAULT_MAX_BODY_MB",
           "DEFAULT_TOKEN_BUDGET"]

DEFAULT_MAX_BODY_MB = 8.0  # a 100k-token prompt is about 0.6 MB of JSON token ids, or 0.4 MB of text
# Tokens per step. Under load a larger step prefills more prompt per launch (an extend step's cost
# grows far slower than its tokens: every expert's weights are read and the launches paid once a
# step) and admits waiting requests sooner. Bench qwen3_next on one H200, 128 requests in flight,
# serve_bench's mix, synchronous steps: 5.1k / 6.1k / 6.5k / 9.6k output tok/s at 512 / 1024 /
# 2048 / 4096 (BENCHMARKS.md, "Serving"). A step's prompt tokens delay the decodes it carries by
# their cost, which a smaller --token-budget trades back.
DEFAULT_TOKEN_BUDGET = 4096


# -- flag types: each value checked as argparse reads it, the flag named in the error -----------------


SEED_LIMIT = 2 ** 63 - 1  # torch's generators take a signed 64-bit seed
PORT_LIMIT = 65535


def int_at_least(least: int, most: int | None = None):
    """argparse type: an integer >= `least` (and <= `most`, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if most is not None and not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be in [{least}, {most}] (got {value})")
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least} (got {value})")
        return value
    return parse


def host_arg(text: str) -> str:
    """argparse type: an address this machine can resolve (a name or a numeric address), checked
    before the model loads rather than when the socket is bound."""
    try:
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address to listen on ({e})") from None
    return text


def float_in(low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = False):
    """argparse type: a number in the interval [low, high] (either end open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high):
            where = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == float('inf') else ']'}"
            raise argparse.ArgumentTypeError(f"must be in {where} (got {text})")
        return value
    return parse


def token_ids(text: str) -> frozenset[int]:
    """argparse type: comma-separated token ids, e.g. "2,7"."""
    try:
        ids = frozenset(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, e.g. 2,7 (got {text!r})") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids are at least 0 (got {text!r})")
    return ids


def device_problem(device: str) -> str | None:
    """Why `device` cannot run hgc on this machine (None: it can)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return f"{device!r} is not a device: expected cpu, cuda or cuda:N"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return f"{device!r}: hgc runs on cpu or cuda"
    if not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        return f"{device}: no GPU here (torch {torch.__version__} {why}); run on cpu (an artifact compiled with --target cpu)"
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        return f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0 ..)"
    return None


def device_arg(text: str) -> str:
    """argparse type: a device this machine has."""
    why = device_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def add_serve_arguments(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a compiled artifact over HTTP (OpenAI-compatible API)",
        description="Load a compiled artifact and serve it over HTTP until SIGTERM: /v1/completions, "
                    "/v1/chat/completions (streamed or not), /v1/models, /health, /metrics. After SIGTERM, "
                    "in-flight requests finish (up to --shutdown-timeout) and new ones get 503 with Retry-After.",
        epilog="examples:\n  hgc serve artifacts/tiny --port 8000\n"
               "  hgc serve artifacts/tiny --port 0 --slots 16 --max-model-len 2048 --memory-budget-gb 4\n"               "  hgc serve artifacts/tiny-tp2 --tp 2 --port 8000   # compiled with --tp 2; rank 0 serves\n"
               "  curl -s localhost:8000/v1/completions -d '{\"model\": \"tiny\", \"prompt\": [1, 2, 3]}'")
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--host", type=host_arg, default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_at_least(0, PORT_LIMIT), default=8000, help="TCP port; 0: any free port (printed on stderr)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: folder name)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder with tokenizer.json (default: the artifact's own, if it has one)")
    p.add_argument("--device", default=None, type=device_arg, metavar="{cpu,cuda,cuda:N}",
                   help="the device the artifact was compiled for (default: its --target): its routing.json binds "
                        "that device's backends; on cuda, CUDA graphs")
    p.add_argument("--no-graphs", action="store_true", help="on cuda: run every step eagerly, capture nothing")
    add_compiled_arguments(p.add_argument_group("compiled pieces"))
    g = p.add_argument_group("engine sizing")
    g.add_argument("--slots", type=int_at_least(1), default=64, help="state slots: requests holding state at once")
    g.add_argument("--max-running", type=int_at_least(1), default=None,
                   help="requests in one step (default: --slots)")
    g.add_argument("--token-budget", type=int_at_least(1), default=DEFAULT_TOKEN_BUDGET,
                   help="tokens per step (prefill chunks and decodes); larger steps serve more under load, smaller "
                        "ones delay the decodes they carry less (default %(default)s)")
    g.add_argument("--page-size", type=int_at_least(1), default=16, help="tokens per KV page")
    g.add_argument("--kv-pages", type=int_at_least(1), default=None,
                   help="KV pages (default: every slot at --max-model-len)")
    g.add_argument("--memory-budget-gb", type=float_in(0, low_open=True), default=None,
                   help="weights + state + KV budget in GiB; the memory planner sizes the KV pool (overrides "
                        "--kv-pages; default: no budget, sized by --slots and --kv-pages)")
    g.add_argument("--max-model-len", type=int_at_least(1), default=None,
                   help="prompt + output tokens of one request (default: min(4096, the model's positions))")
    add_overlap_argument(g)
    g = p.add_argument_group("prefix cache")
    add_prefix_cache_arguments(g)
    g.add_argument("--prefix-snapshots", type=int_at_least(0), default=None,
                   help="linear-state snapshots the prefix cache may hold, without --memory-budget-gb "
                        "(default: one per slot)")
    g.add_argument("--snapshot-share", type=float_in(0, 1, high_open=True), default=0.1,
                   help="with --memory-budget-gb: the share of the memory after weights that goes to snapshots")
    add_speculative_argument(p.add_argument_group("speculative decoding"))
    g = p.add_argument_group("requests")
    g.add_argument("--max-tokens-limit", type=int_at_least(1), default=None,
                   help="largest max_tokens a request may ask for (default: --max-model-len)")
    g.add_argument("--default-max-tokens", type=int_at_least(1), default=16,
                   help="max_tokens of a completion that sends none")
    g.add_argument("--max-body-mb", type=float_in(0, low_open=True), default=DEFAULT_MAX_BODY_MB,
                   help="largest request body in MB (10^6 bytes); a larger one gets 413 before it is read")
    g.add_argument("--shutdown-timeout", type=float_in(0), default=10.0,
                   help="seconds from SIGTERM to exit: in-flight requests run until min(3, half of it) seconds "
                        "before the end, then are cancelled with a last chunk (default 10: they get 7 s)")
    add_tp_arguments(p.add_argument_group("tensor parallel and weights"))
    g = p.add_argument_group("process")
    g.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--engine-in-process", action="store_true",
                   help="step the engine on a thread of the HTTP server's process, for comparison and debugging. "
                        "Default: the engine core runs in a process of its own, so HTTP, tokenization and "
                        "detokenization never take the interpreter from its steps; --tp N always runs in process "
                        "(rank 0 serves HTTP beside its engine)")
    g.add_argument("--engine-core", default=None, metavar="FOLDER", help=argparse.SUPPRESS)  # the core's own flag
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's and the server's log level")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_serve)
    return p


def add_prefix_cache_arguments(group) -> None:
    """The prefix-cache flags `hgc serve` and `hgc run` share."""
    group.add_argument("--no-prefix-cache", action="store_true",
                       help="prefill every prompt in full: no reuse of cached prefixes (KV pages, "
                            "linear-state snapshots)")
    group.add_argument("--snapshot-interval", type=int_at_least(1), default=None,
                       help="tokens between a request's snapshots at prefill chunk ends (default: "
                            "DEFAULT_SNAPSHOT_INTERVAL in runtime/cache/prefix_cache.py); prompt ends and branch points "
                            "are snapshotted regardless")


def add_overlap_argument(group) -> None:
    """The schedule's flags `hgc serve` and `hgc run` share: the overlapped schedule, decodes apart
    (read with `schedule_options`)."""
    group.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=True,
                       help="the host schedules and launches step N+1 while the device runs step N, whose greedy "
                            "tokens feed it on the device and are read one step late (steps with draws, grammars, "
                            "penalties, log-probabilities, shared prefills, preemption or speculative decoding stay "
                            "synchronous; --tp N turns it off). --no-overlap-schedule lays out each step only after "
                            "the one before was read, for comparison and debugging")
    group.add_argument("--decodes-apart-from", type=int_at_least(0), default=None, metavar="N",
                       help="a step with prompt chunks and at least N decodes runs the decodes as a forward of their "
                            "own, through the decode graphs, instead of as one-token requests on the prompt's extend "
                            "path (the linear layers' chunk kernels spend a chunk on each); 0: never (default: "
                            "runtime/assembly.EngineOptions.decodes_apart_from, 16)")


def schedule_options(args) -> dict:
    """EngineOptions fields from the flags of `add_overlap_argument`."""
    options = {"overlap": args.overlap_schedule}
    if args.decodes_apart_from is not None:
        options["decodes_apart_from"] = args.decodes_apart_from
    return options


def add_speculative_argument(group) -> None:
    """The speculative-decoding flag `hgc serve` and `hgc run` share."""
    # 1..7 is checked by EngineOptions (runtime/engine/speculative.MAX_DRAFT_TOKENS), before anything loads
    group.add_argument("--speculative-tokens", type=int_at_least(0), default=0, metavar="D",
                       help="draft D tokens per decoding request with the artifact's MTP draft program and verify "
                            "them in one target_verify step (1..7; default 0: no speculation). Greedy tokens are "
                            "plain decoding's where a verify row computes what a decode step does: in float32, "
                            "and in bf16 for an artifact compiled with --batch-invariant (README, speculative "
                            "decoding); otherwise bf16 kernels of other shapes may decide a near tie the other way")


def add_tp_arguments(group) -> None:
    """The tensor-parallel and weight-loading flags `hgc serve` and `hgc run` share."""
    from runtime.dist.distributed import DEFAULT_TIMEOUT_S
    from runtime.artifact.weights import LOAD_FORMATS

    group.add_argument("--tp", type=int_at_least(1), default=1, metavar="N",
                       help="tensor-parallel ranks, one process each (the artifact must be compiled with --tp N); "
                            "launches them, or runs as one of them under torchrun")
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="auto: the artifact's weights; dummy: random weights of the right shapes made on the "
                            "device (an artifact compiled with --no-weights from config.json alone)")
    group.add_argument("--tp-timeout", type=float_in(0, low_open=True), default=DEFAULT_TIMEOUT_S, metavar="S",
                       help="seconds a collective may wait for the other ranks before the run fails")


def start_ranks(args, command: str):
    """--tp N: (exit code, None) in the process that launches the ranks (it returns when they end);
    (None, RankGroup) in a rank (our launch's or torchrun's); (None, None) for --tp 1. In a rank,
    `args.rank` is set: its failures then name it (hgc/errors.py)."""
    from runtime.artifact.docs import LoadError, read_artifact
    from runtime.dist.distributed import join, launched_rank
    from runtime.dist.launcher import launch
    from runtime.artifact.weights import check_load_format

    if args.tp == 1:
        return None, None
    if args.speculative_tokens:  # before the artifact is read or any process starts
        raise ValueError(f"--speculative-tokens {args.speculative_tokens} --tp {args.tp}: speculative decoding does "
                         f"not run on tensor-parallel ranks yet (its draft and verify steps are not sent to the other "
                         f"ranks); run with --tp {args.tp} alone, or draft on an artifact compiled without --tp")
    docs = read_artifact(args.artifact, verify_hashes=False)  # the loader checks the hashes, in each rank
    check_load_format(docs, args.load_format)  # before any process starts
    if docs.tp != args.tp:
        raise LoadError(f"{docs.path}: compiled for --tp {docs.tp}, asked to run on {args.tp} ranks: run it with "
                        f"{f'--tp {docs.tp}' if docs.tp > 1 else 'one process (no --tp)'}, or recompile with "
                        f"`hgc compile --tp {args.tp}`")
    if not launched_rank():
        return launch(args.tp, [sys.executable, "-m", "hgc", *args.argv], f"hgc {command}"), None
    import torch

    device = args.device or docs.routing.target
    group = join(args.tp, torch.device(device).type, args.tp_timeout, label=f"hgc {command}")
    args.rank = group.rank
    return None, group


def prefix_cache_options(args) -> dict:
    """EngineOptions fields from the flags of `add_prefix_cache_arguments`."""
    options = {"prefix_cache": not args.no_prefix_cache}
    if args.snapshot_interval is not None:
        options["snapshot_interval"] = args.snapshot_interval
    return options


def add_compiled_arguments(group) -> None:
    """The flags `hgc serve` and `hgc run` share about an artifact's target bundle (runtime/artifact/bundle.py)."""
    group.add_argument("--no-compiled", action="store_true",
                       help="ignore the artifact's target bundles: run the traced glue, load no compiled code")
    group.add_argument("--trust-compiled", action="store_true",
                       help="run a bundle's compiled code although this installation did not build (sign) it")
    group.add_argument("--allow-kernel-builds", action="store_true",
                       help="build at start-up the kernels a bundle lacks, instead of refusing to start")


def compiled_options(args):
    """CompiledOptions from the flags of `add_compiled_arguments`."""
    from runtime.artifact.bundle import CompiledOptions
    return CompiledOptions(enabled=not args.no_compiled, trust=args.trust_compiled,
                           allow_builds=args.allow_kernel_builds)


def cmd_serve(args) -> int:
    """Load and serve; a refusal (LoadError, MemoryPlanError, TokenizerError, a bad option) or a
    start-up failure (CaptureError, ParityError) is raised for the caller to print as one line.
    With --tp N this process launches the ranks and returns how they ended, or is one of them."""
    if args.engine_core is not None:
        return _serve_core(args)
    code, group = start_ranks(args, "serve")
    if code is not None:
        return code  # this process launched the ranks; they have ended
    if group is None and not args.engine_in_process:
        return _serve_split(args)
    try:
        return _serve_rank(args, group)
    finally:
        if group is not None:
            group.close()


def _serve_rank(args, group) -> int:
    """`hgc serve` in one process: the only one (--engine-in-process), rank 0 of a tensor-parallel
    launch (which serves), or another rank (which follows rank 0's steps until rank 0 stops)."""
    from runtime.dist.distributed import follow

    rank = group.rank if group is not None else 0
    sock = bind_socket(args.host, args.port) if rank == 0 else None  # refused before the model loads
    served = _load(args, group)
    if rank > 0:
        follow(served.engine, group)  # until rank 0 sends STOP (it shuts down) or stops
        return 0
    code = serve(served, _server_options(args), sock, summary=_engine_summary(served), log_level=args.log_level,
                 access_log=args.access_log)
    if group is not None:
        group.close()  # STOP to the other ranks: they end with this process, which ends at once below
    _end_process(code)


def _load(args, group):
    """The ServedModel of the flags (runtime/assembly.load_served_model): in the engine core, or in
    the one process (or each rank) that serves with its engine in process."""
    import torch

    from runtime.assembly import load_served_model

    if args.threads:
        torch.set_num_threads(args.threads)
    rank, tp = (group.rank, group.world_size) if group is not None else (0, 1)

    def log(line: str) -> None:  # rank 0 speaks for every rank (they load and start alike)
        if rank == 0:
            print(f"hgc serve: {line}", file=sys.stderr, flush=True)

    log(f"loading {args.artifact} ...")
    return load_served_model(args.artifact, name=args.served_model_name, options=_engine_options(args),
                             tokenizer_dir=args.tokenizer, device=group.device if group is not None else args.device,
                             graphs=not args.no_graphs, compiled=compiled_options(args), log=log,
                             progress=getattr(args, "progress", None) if rank == 0 else None,
                             rank=rank, tp=tp, load_format=args.load_format,
                             tp_lead=group if rank == 0 else None)


def _engine_options(args):
    """The EngineOptions of the flags (a combination they refuse is refused here, as one line)."""
    from runtime.assembly import EngineOptions

    return EngineOptions(
        slots=args.slots, max_running=args.max_running, token_budget=args.token_budget, page_size=args.page_size,
        kv_pages=args.kv_pages, max_model_len=args.max_model_len,
        memory_budget_bytes=None if args.memory_budget_gb is None else int(args.memory_budget_gb * (1 << 30)),
        prefix_snapshots=args.prefix_snapshots, snapshot_share=args.snapshot_share,
        speculative_tokens=args.speculative_tokens, **schedule_options(args), **prefix_cache_options(args))


def _server_options(args):
    from runtime.server.app import ServerOptions

    return ServerOptions(max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                         shutdown_timeout=args.shutdown_timeout, max_body_bytes=int(args.max_body_mb * 1_000_000))


def _serve_split(args) -> int:
    """`hgc serve`'s default: this process serves HTTP; the engine core, a process of its own, loads
    the model and steps it (runtime/core/). A refusal of the core's (a bad artifact or budget) is
    raised here as its own one line and exit status."""
    from runtime.assembly import check_served_inputs
    from runtime.core.client import EngineCoreClient
    from runtime.core.messages import served_from_wire

    server_options = _server_options(args)  # its refusals before anything starts
    # and what the flags and the artifact's documents decide: in about a second, not after the
    # core's start and imports
    check_served_inputs(args.artifact, _engine_options(args), args.tokenizer)
    sock = bind_socket(args.host, args.port)  # refused before the model loads
    with tempfile.TemporaryDirectory(prefix="hgc-core-") as folder:  # the two IPC sockets
        client = EngineCoreClient.launch([sys.executable, "-m", "hgc", *args.argv, "--engine-core"], folder)
        try:
            served, summary = served_from_wire(client.facts)
            code = serve(served, server_options, sock, engine=client, summary=summary, log_level=args.log_level,
                         access_log=args.access_log)
        finally:
            if client.process.poll() is None:  # `serve` never started the client: end the core here
                client.process.kill()
    _end_process(code)


def _serve_core(args) -> int:
    """This process is a split `hgc serve`'s engine core (--engine-core FOLDER): load, say ready (or
    refuse with the one line the server prints), then step until the server says stop or is gone."""
    from hgc.errors import classify, failure_message
    from runtime.core.process import CoreChannel, serve_engine
    from runtime.core.messages import served_to_wire
    from runtime.engine.grammar import Grammars

    # The server decides when the core ends ("stop", or its own exit): a Ctrl-C or a SIGTERM sent
    # to the process group must not kill the engine under requests the server is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = CoreChannel(args.engine_core)
    try:
        try:
            served = _load(args, None)
        except Exception as error:  # noqa: BLE001 - every refusal becomes the server's one line
            if args.debug:
                traceback.print_exception(error, file=sys.stderr)
            code, hint = classify(error)
            channel.refused(code, failure_message(error), hint)
            return code
        channel.ready(served_to_wire(served, _engine_summary(served)))
        grammars = Grammars(served.tokenizer, served.vocab_size, [served.eos_token_id])
        return serve_engine(channel, served.engine, compile_grammar=grammars.compile, counters=served.counters)
    finally:
        channel.close()


def _end_process(code: int) -> NoReturn:
    """Step 4 of the module docstring: the server has stopped; end without the interpreter's teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _engine_summary(served) -> str:
    """What the "listening" line says of the engine."""
    engine = served.engine
    return (f"max_model_len {served.max_model_len}, {engine.state_pool.num_slots} slots, "
            f"{engine.kv_pool.num_pages} KV pages, {_prefix_cache_line(engine)}")


def _prefix_cache_line(engine) -> str:
    cache = engine.prefix_cache
    if cache is None:
        return "no prefix cache"
    return (f"prefix cache: {cache.snapshots.num_snapshots} snapshots, "
            f"{cache.snapshots.nbytes() / (1 << 20):.1f} MiB")


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening); a refusal names the flags."""
    try:
        return _bind(host, port)
    except OSError as e:
        from hgc.errors import UsageError

        raise UsageError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}",
                         hint="pick a free port (--port 0 takes any) or an address of this machine") from None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP. With it on, a response's body waited for the client's
    # delayed ACK of its headers: 40 ms on every /health and every streamed chunk.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart must not wait out TIME_WAIT
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(served, options, sock: socket.socket, *, summary: str, engine=None, log_level: str = "info",
          access_log: bool = False) -> int:
    """Serve `served` (a ServedModel) on `sock` (from `bind_socket`) until a signal; 0 after a clean
    shutdown, 1 if it never started or its engine failed. `engine`: the engine core's client
    (runtime/core/client.py), None to step served.engine in this process; a core that dies ends
    the server (its requests fail first), with status 1. `summary`: the engine's part of the
    "listening" line."""
    import uvicorn

    from runtime.server.app import ServerOptions, create_app

    options = options or ServerOptions()
    # The app logs to "hgc.server"; uvicorn configures only its own loggers, so give ours a handler.
    logger = logging.getLogger("hgc.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(log_level.upper())
    app = create_app(served, options, engine)
    state = app.state.hgc

    class _Server(uvicorn.Server):
        asked_to_exit = False

        def handle_exit(self, sig, frame) -> None:
            # Not super(): uvicorn would stop listening at once (new clients would find the port
            # closed instead of a 503), and it records the signal to re-raise after shutdown (exit
            # status 143); a drained shutdown on SIGTERM is a success here, so the process exits 0.
            # The app drains first, listening, and then sets should_exit; a second Ctrl-C forces.
            if self.asked_to_exit and sig == signal.SIGINT:
                self.should_exit = self.force_exit = True
            self.asked_to_exit = True
            state.request_shutdown(exit_server=lambda: setattr(self, "should_exit", True))

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                bound_host, bound_port = sockets[0].getsockname()[:2]
                print(f"hgc serve: {served.name} listening on http://{bound_host}:{bound_port} ({summary})",
                      file=sys.stderr, flush=True)

    # uvicorn's own graceful wait starts once the app has drained (or cancelled) its requests: the
    # grace the streams get to send their last chunk.
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=max(options.shutdown_timeout - options.abort_after, 1.0))
    server = _Server(config)
    if engine is not None:
        def core_died() -> None:  # on the client's receiving thread, once its open requests have failed
            logger.error("hgc serve: %s: shutting down", engine.error)
            state.request_shutdown(exit_server=lambda: setattr(server, "should_exit", True))
        engine.on_death = core_died
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started and state.healthy else 1

