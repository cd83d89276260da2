"""How a command fails: one exit-code scheme, one line naming the culprit, a hint, no traceback.

    0    ok
    1    runtime failure: the input was accepted and something failed while working on it (a CUDA
         graph capture, start-up parity, the engine, the disk, a bug)
    2    bad input or usage: a flag, a checkpoint, an artifact or a request the command refuses,
         found before any work where it can be (limits, devices, files)
    130  interrupted (Ctrl-C): whatever was half written is removed first

A closed stdout pipe (`hgc inspect A | head`) ends the command quietly with 0: the reader has read
what it wanted.

1. `CommandParser` is the parser class of `hgc` and of every subcommand: an argparse error
   prints `hgc COMMAND: argument --flag: what is wrong` and a hint, not the usage block, and
   exits 2 (argparse's own code for usage errors). A flag is spelled out: no prefixes.
2. `run_with_errors(args)` runs the chosen command and turns whatever it raises into one line
   `hgc COMMAND: <message>` on stderr, a hint line, and the exit code of `classify` (Ctrl-C: the
   one line `hgc COMMAND: interrupted (Ctrl-C); ...`, exit 130). `--debug` prints the traceback
   first. In a rank of a tensor-parallel launch (`args.rank`, set by hgc/serve_command.start_ranks)
   the line names the rank: `hgc COMMAND: rank N: <message>`.
3. `classify(error)` is the one table from failure class to exit code and hint. A command raises
   its refusals (UsageError, CheckpointError, CompileError, LoadError, ...); it prints nothing on
   failure itself. A failure classified in another process (`hgc serve`'s engine core: its
   `failure_message` and code travel to the server) carries its `exit_code` and `hint`.

What it does not do: validate anything (the commands and the modules they call do).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import traceback

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_CODES", "UsageError",
           "CommandParser", "HelpFormatter", "classify", "failure_message", "print_failure", "run_with_errors"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C

EXIT_CODES = {EXIT_OK: "ok", EXIT_FAILED: "runtime failure", EXIT_BAD_INPUT: "bad input or usage",
              EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}


class UsageError(ValueError):
    """A command-line argument the user can fix (exit code 2); `hint` says how, when the message does not."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Long description lines are wrapped to the terminal, indented lines (examples) kept as they
    are; every option with a default shows it, unless its help already says what the default is
    (an option whose default is computed)."""

    def _fill_text(self, text, width, indent) -> str:
        lines = []
        for line in text.splitlines():
            if line.startswith(" ") or len(line) <= width:
                lines.append(indent + line)
            else:
                lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent)
        return "\n".join(lines)

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        # identity, not ==: a default of 0 or 0.0 is a value to show, unlike None or a flag's False
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and a hint (subparsers inherit the class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        # No prefix matching: with it `--max-new-token 3` ran as --max-new-tokens, and a flag added
        # later could silently change what an old command line means.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook: it must not return
        print(f"{self.prog}: {message}", file=sys.stderr)
        print(f"  hint: `{self.prog} --help` lists every option with its default and an example", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _bad_input_classes() -> tuple[type, ...]:
    """The refusals of every layer: each names the file, field, flag or layer at fault."""
    from compiler.splitops.artifact import ArtifactFormatError
    from compiler.splitops.errors import CompileError
    from models.common import CheckpointError
    from runtime.artifact.docs import LoadError
    from runtime.backends import BackendDiscoveryError
    from runtime.cache.memory_planner import MemoryPlanError
    from runtime.artifact.tokenizer import TokenizerError

    return (UsageError, CheckpointError, CompileError, LoadError, ArtifactFormatError, TokenizerError,
            MemoryPlanError, BackendDiscoveryError)


# A hint per failure class, for messages that do not already say what to do.
_HINTS = {
    "CheckpointError": "a checkpoint folder holds config.json and *.safetensors; `hgc lint CKPT` checks one "
                       "without loading weights",
    "LoadError": "`hgc verify ARTIFACT` re-checks every file; `hgc compile CKPT -o ARTIFACT --force` rebuilds it",
    "ArtifactFormatError": "`hgc verify ARTIFACT` re-checks every file; `hgc compile CKPT -o ARTIFACT --force` "
                           "rebuilds it",
    "MemoryPlanError": "fewer or shorter requests fit: lower --max-new-tokens or the number of prompts",
    "LintFailure": "`hgc lint CKPT` shows the routing table, the split plans and every finding",
}


def classify(error: BaseException) -> tuple[int, str]:
    """(exit code, hint) of a failure."""
    from compiler.passes.base import PassError

    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, ""
    if isinstance(getattr(error, "exit_code", None), int):  # classified where it happened (an engine core's refusal)
        return error.exit_code, getattr(error, "hint", None) or ""
    if isinstance(error, PassError) and not isinstance(error.cause, _bad_input_classes()):
        return EXIT_FAILED, "a pass failed on an input it accepted: run again with --debug for the traceback"
    hint = getattr(error, "hint", None)
    for cls in type(error).__mro__:
        hint = hint or _HINTS.get(cls.__name__)
    if isinstance(error, _bad_input_classes()) or isinstance(error, (FileExistsError, FileNotFoundError,
                                                                     NotADirectoryError, IsADirectoryError,
                                                                     PermissionError)):
        return EXIT_BAD_INPUT, hint or "`hgc COMMAND --help` lists every option with its default and an example"
    if isinstance(error, ValueError):  # the option checks of the engine and the sampler (SamplingParams, ...)
        return EXIT_BAD_INPUT, hint or "`hgc COMMAND --help` lists every option with its default and an example"
    return EXIT_FAILED, hint or "run again with --debug for the traceback"


def failure_message(error: BaseException) -> str:
    """The one line `print_failure` prints of a failure, without the command."""
    from compiler.splitops.errors import CompileError

    if isinstance(error, KeyboardInterrupt):  # every writer removes its staging folder on the way out
        return "interrupted (Ctrl-C); nothing half written was left behind"
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename and str(error.filename) not in text:
        text = f"{error.filename}: {text}"
    if type(error).__module__ == "builtins" and not isinstance(error, (ValueError, OSError)):
        text = f"{type(error).__name__}: {text}"  # a bare KeyError('x') says nothing without its class
    if not isinstance(error, CompileError):  # a compile failure lists one finding a line; others get one line
        text = text.splitlines()[0]
    return text


def _reader_left() -> int:
    """stdout's reader is gone: what is still buffered goes nowhere, so the exit flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def print_failure(command: str, error: BaseException, debug: bool = False, rank: int | None = None) -> int:
    """The failure's line(s) and hint on stderr; returns its exit code. `rank`: the rank of a
    tensor-parallel launch this process is (its ranks share one stderr), named after the command."""
    code, hint = classify(error)
    if debug and not isinstance(error, KeyboardInterrupt):
        traceback.print_exception(error, file=sys.stderr)
    prefix = f"hgc {command}: "
    message = failure_message(error)
    if message.startswith(prefix):  # raised with the command already named
        message = message[len(prefix):]
    print(prefix + ("" if rank is None else f"rank {rank}: ") + message, file=sys.stderr, flush=True)
    if hint:  # Ctrl-C has none: the user knows why it stopped
        print(f"  hint: {hint.replace('COMMAND', command)}", file=sys.stderr, flush=True)
    return code


def run_with_errors(args) -> int:
    """`args.func(args)`, with every failure as `print_failure` prints it. A reader that closed the
    pipe (`hgc inspect A | head`) has what it wanted: exit 0, quietly."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a message from the interpreter's teardown
        return code
    except BrokenPipeError:
        return _reader_left()
    except (Exception, KeyboardInterrupt) as e:  # not SystemExit: --help and parser errors exit themselves
        return print_failure(args.command, e, debug=getattr(args, "debug", False), rank=getattr(args, "rank", None))
