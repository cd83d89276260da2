"""The `hgc` command line: the top floor, wiring the compiler, the models and the runtime together.

    hgc init-model / generate / demo                hgc/model_commands.py
    hgc lint / compile / inspect / verify / backends hgc/compile_commands.py
    hgc build                                       hgc/build_command.py
    hgc run                                         hgc/run_command.py
    hgc serve ARTIFACT --host 127.0.0.1 --port N    hgc/serve_command.py

Below it, the op vocabulary (compiler/splitops) is the ground floor; models/, runtime/ and the
compiler's passes stand side by side on it and import none of each other. Only this package
imports all of them: hgc/wiring.py hands the compiler the backends' capability table and
the model reader (docs/DESIGN.md, "Dependency direction"; tests/architecture/test_imports.py checks it).

Every command fails the same way (hgc/errors.py): one line naming the file, field, flag
or layer at fault, a hint, and an exit code from one scheme (0 ok, 1 runtime failure, 2 bad input
or usage, 130 interrupted); `--debug` adds the traceback. Progress bars (hgc/progress.py)
show on a terminal only, and never with `--quiet`.
"""

from __future__ import annotations

import argparse
import sys

from hgc.errors import EXIT_CODES, CommandParser, UsageError, run_with_errors
from hgc.progress import progress_bars
from hgc.prompts import parse_prompt_ids

__all__ = ["main", "parse_prompt_ids", "build_parser", "version_text", "UsageError"]

DESCRIPTION = """\
hgc compiles hybrid linear-attention language models (Qwen3-Next / Qwen3.5, Kimi-Linear, Ling / Ring
linear) ahead of time and serves them: a checkpoint is traced, every attention node is bound to a
backend, the graph is cut at the linear-attention ops, and the result is an artifact folder the
runtime loads without running code from it."""

EPILOG = """\
a first session:
  hgc init-model --family qwen3_next --size tiny -o /tmp/ckpt
  hgc generate /tmp/ckpt --prompt-ids "1,2,3;4,5" --max-new-tokens 8
  hgc compile /tmp/ckpt -o artifacts/tiny
  hgc run artifacts/tiny --prompt-ids "1,2,3;4,5" --max-new-tokens 8
  hgc serve artifacts/tiny --port 8000

exit codes:
""" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES.items())

# Libraries the GPU backends import; `hgc --version` says which of them this environment can import.
GPU_LIBRARIES = (("triton", "triton"), ("flashinfer", "flashinfer-python"), ("fla", "fla-core"))


def version_text() -> str:
    """hgc's version, torch's (and its CUDA), and which GPU libraries import here."""
    import importlib
    import importlib.metadata
    import importlib.util

    import torch

    from compiler.artifact_writer import hgc_version

    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible" if torch.version.cuda
            else "built without CUDA")
    lines = [f"hgc {hgc_version()}", f"torch {torch.__version__} ({cuda})"]
    for module, dist in GPU_LIBRARIES:
        if importlib.util.find_spec(module) is None:
            lines.append(f"{module}: not installed")
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # a GPU library on a machine without its driver: say why, do not fail
            lines.append(f"{module}: installed, not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
        lines.append(f"{module} {version}: importable")
    return "\n".join(lines)


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def _add_common_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and no timing line (bars also stay off when stderr is not a terminal)")
    g.add_argument("--debug", action="store_true", help="on failure, print the traceback before the one-line error")


def build_parser() -> argparse.ArgumentParser:
    from hgc.build_command import add_build_arguments
    from hgc.compile_commands import add_arguments
    from hgc.model_commands import add_model_arguments
    from hgc.run_command import add_run_arguments
    from hgc.serve_command import add_serve_arguments

    parser = CommandParser(prog="hgc", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=_Version,
                        help="print the versions of hgc and torch, and which GPU libraries import here")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_model_arguments(sub)
    add_arguments(sub)
    add_build_arguments(sub)
    add_run_arguments(sub)
    add_serve_arguments(sub)
    for command in sub.choices.values():
        _add_common_options(command)
    parser.commands = sub.choices  # name -> its parser: an unknown flag is reported by its command
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would name `hgc`, not the command whose flags these are not
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help, --version, or a usage error already printed as one line
        return e.code if isinstance(e.code, int) else 0
    args.progress = progress_bars(args)  # what every command hands its long loops (None with --quiet)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the ranks of a --tp launch run again
    code = run_with_errors(args)
    if getattr(args, "rank", None) is not None:  # a rank of a --tp launch (set by start_ranks)
        from runtime.dist.distributed import end_rank_process
        end_rank_process(code)
    return code
