"""`hgc serve ARTIFACT`: load a compiled artifact and serve it over HTTP until SIGTERM.

    hgc serve artifacts/tiny --host 127.0.0.1 --port 8000 --slots 64 --token-budget 512
    python -m runtime.server artifacts/tiny --port 0        # the same, without the hgc entry point

1. `add_serve_arguments(subparsers)` registers the command (compiler/cli.py calls it);
   `cmd_serve(args)` loads the model (model.py) and calls `serve`.
2. `serve(served, options, host, port)` binds the socket itself (so `--port 0` works and the
   port is known), prints one "listening" line on stderr once uvicorn accepts connections, and
   runs until SIGTERM or SIGINT.
3. SIGTERM: stop accepting, let in-flight requests finish for up to --shutdown-timeout seconds
   (cancelling them shortly before), stop the engine, exit 0. uvicorn re-raises the signal after
   its shutdown by default, which would end the process with status 143; `_Server` keeps the
   exit clean instead.

Errors a user can fix (a bad artifact, bad flags, a budget too small) print one line and return 2.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys

__all__ = ["add_serve_arguments", "add_prefix_cache_arguments", "add_speculative_argument", "prefix_cache_options", "cmd_serve", "serve", "main"]


def add_serve_arguments(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a compiled artifact over HTTP (OpenAI-compatible API)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed on stderr)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: folder name)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder with tokenizer.json (default: the artifact's own, if it has one)")
    p.add_argument("--device", default=None,
                   help="the device the artifact was compiled for (default: its --target): its routing.json binds "
                        "that device's backends; on cuda, CUDA graphs")
    p.add_argument("--no-graphs", action="store_true", help="on cuda: run every step eagerly, capture nothing")
    g = p.add_argument_group("engine sizing")
    g.add_argument("--slots", type=int, default=64, help="state slots: requests holding state at once")
    g.add_argument("--max-running", type=int, default=None, help="requests in one step (default: --slots)")
    g.add_argument("--token-budget", type=int, default=512, help="tokens per step (prefill chunks and decodes)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--kv-pages", type=int, default=None,
                   help="KV pages (default: every slot at --max-model-len)")
    g.add_argument("--memory-budget-gb", type=float, default=None,
                   help="weights + state + KV budget in GiB; the memory planner sizes the KV pool (overrides "
                        "--kv-pages)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens of one request (default: min(4096, the model's positions))")
    g = p.add_argument_group("prefix cache")
    add_prefix_cache_arguments(g)
    g.add_argument("--prefix-snapshots", type=int, default=None,
                   help="linear-state snapshots the prefix cache may hold, without --memory-budget-gb "
                        "(default: one per slot)")
    g.add_argument("--snapshot-share", type=float, default=0.1,
                   help="with --memory-budget-gb: the share of the memory after weights that goes to snapshots")
    add_speculative_argument(p.add_argument_group("speculative decoding"))
    g = p.add_argument_group("requests")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: --max-model-len)")
    g.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens of a completion that sends none")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get after SIGTERM before they are cancelled")
    g = p.add_argument_group("process")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_serve)
    return p


def add_prefix_cache_arguments(group) -> None:
    """The prefix-cache flags `hgc serve` and `hgc run` share."""
    group.add_argument("--no-prefix-cache", action="store_true",
                       help="prefill every prompt in full: no reuse of cached prefixes (KV pages, "
                            "linear-state snapshots)")
    group.add_argument("--snapshot-interval", type=int, default=None,
                       help="tokens between a request's snapshots at prefill chunk ends (default: "
                            "DEFAULT_SNAPSHOT_INTERVAL in runtime/prefix_cache.py); prompt ends and branch points "
                            "are snapshotted regardless")


def add_speculative_argument(group) -> None:
    """The speculative-decoding flag `hgc serve` and `hgc run` share."""
    group.add_argument("--speculative-tokens", type=int, default=0, metavar="D",
                       help="draft D tokens per decoding request with the artifact's MTP draft program and verify "
                            "them in one target_verify step (1..7; default 0: no speculation)")


def prefix_cache_options(args) -> dict:
    """EngineOptions fields from the flags of `add_prefix_cache_arguments`."""
    options = {"prefix_cache": not args.no_prefix_cache}
    if args.snapshot_interval is not None:
        options["snapshot_interval"] = args.snapshot_interval
    return options


def cmd_serve(args) -> int:
    import torch

    from runtime.graph_runner import CaptureError, ParityError
    from runtime.loader import LoadError
    from runtime.memory_planner import MemoryPlanError
    from runtime.server.app import ServerOptions
    from runtime.server.model import EngineOptions, load_served_model
    from runtime.tokenizer import TokenizerError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine_options = EngineOptions(
            slots=args.slots, max_running=args.max_running, token_budget=args.token_budget, page_size=args.page_size,
            kv_pages=args.kv_pages, max_model_len=args.max_model_len,
            memory_budget_bytes=None if args.memory_budget_gb is None else int(args.memory_budget_gb * (1 << 30)),
            prefix_snapshots=args.prefix_snapshots, snapshot_share=args.snapshot_share,
            speculative_tokens=args.speculative_tokens, **prefix_cache_options(args))
        server_options = ServerOptions(max_tokens_limit=args.max_tokens_limit,
                                       default_max_tokens=args.default_max_tokens,
                                       shutdown_timeout=args.shutdown_timeout)
        print(f"hgc serve: loading {args.artifact} ...", file=sys.stderr, flush=True)
        served = load_served_model(args.artifact, name=args.served_model_name, options=engine_options,
                                   tokenizer_dir=args.tokenizer, device=args.device, graphs=not args.no_graphs,
                                   log=lambda line: print(f"hgc serve: {line}", file=sys.stderr, flush=True))
    except (LoadError, MemoryPlanError, TokenizerError, ValueError, FileNotFoundError, CaptureError,
            ParityError) as e:
        print(f"hgc serve: {e}", file=sys.stderr)
        return 2
    code = serve(served, server_options, args.host, args.port, log_level=args.log_level, access_log=args.access_log)
    # The process ends next. Its finalizer would run full collections over the whole heap (torch,
    # the programs, fastapi) as modules are cleared: seconds on a busy machine, after a shutdown
    # that is meant to be bounded. Frozen objects are skipped by those collections.
    gc.freeze()
    return code


def _prefix_cache_line(engine) -> str:
    cache = engine.prefix_cache
    if cache is None:
        return "no prefix cache"
    return (f"prefix cache: {cache.snapshots.num_snapshots} snapshots, "
            f"{cache.snapshots.nbytes() / (1 << 20):.1f} MiB")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart must not wait out TIME_WAIT
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(served, options=None, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          access_log: bool = False) -> int:
    """Serve `served` (a ServedModel) until a signal; 0 after a clean shutdown, 1 if it never started."""
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
    app = create_app(served, options)
    state = app.state.hgc

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Not super(): uvicorn records the signal to re-raise after shutdown (exit status 143);
            # a drained shutdown on SIGTERM is a success here, so the process exits 0.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True
            state.request_shutdown()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                bound_host, bound_port = sockets[0].getsockname()[:2]
                print(f"hgc serve: {served.name} listening on http://{bound_host}:{bound_port} "
                      f"(max_model_len {served.max_model_len}, {served.engine.state_pool.num_slots} slots, "
                      f"{served.engine.kv_pool.num_pages} KV pages, {_prefix_cache_line(served.engine)})",
                      file=sys.stderr, flush=True)

    try:
        sock = _bind(host, port)
    except OSError as e:
        print(f"hgc serve: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=max(options.shutdown_timeout, 0.1))
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub).prog = parser.prog  # usage and errors read like the command that was typed
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
