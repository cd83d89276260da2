"""The `hgc` command line: the top floor, wiring the compiler, the models and the runtime together.

    hgc init-model / generate / demo       compiler/cli/model_commands.py
    hgc lint / compile / inspect / backends compiler/cli/compile_commands.py
    hgc run                                compiler/cli/run_command.py
    hgc serve ARTIFACT --host 127.0.0.1 --port N   runtime/server/cli.py

Below it, the op vocabulary (compiler/splitops) is the ground floor; models/, runtime/ and the
compiler's passes stand side by side on it and import none of each other. Only this package
imports all of them: compiler/cli/wiring.py hands the compiler the backends' capability table and
the model reader (docs/DESIGN.md, "Dependency direction"; tests/test_imports.py checks it).

Errors a user can fix (bad checkpoint, bad arguments) print one line and exit 2; nothing else
is caught.
"""

from __future__ import annotations

import argparse
import sys

from compiler.cli.prompts import UsageError, parse_prompt_ids

__all__ = ["main", "parse_prompt_ids", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from compiler.cli.compile_commands import add_arguments
    from compiler.cli.model_commands import add_model_arguments
    from compiler.cli.run_command import add_run_arguments
    from runtime.server.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="hgc", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_model_arguments(sub)
    add_arguments(sub)
    add_run_arguments(sub)
    add_serve_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from models.common import CheckpointError

    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) is not None and getattr(args, "max_new_tokens", 1) < 1:
        print("hgc: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (CheckpointError, UsageError, FileExistsError) as e:
        print(f"hgc {args.command}: {e}", file=sys.stderr)
        return 2
