"""The command line teaches itself: every subcommand has a description and an example, every option
a help text and its default, closed sets their choices; `hgc --version` names what is installed;
progress bars draw only where asked."""

from __future__ import annotations

import argparse
import functools
import io

import pytest

from hgc import build_parser, main

COMMANDS = build_parser().commands


def options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_hgc_help_describes_the_tool_lists_every_command_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "hybrid linear-attention" in text and "a first session:" in text and "exit codes:" in text
    for name in COMMANDS:
        assert f"    {name}" in text, name
    assert "130  interrupted (Ctrl-C)" in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_a_description_an_example_and_helped_options(name):
    parser = COMMANDS[name]
    assert parser.description and len(parser.description) > 40, name
    assert parser.epilog and "example" in parser.epilog and f"hgc {name}" in parser.epilog, name
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"hgc {name} {action.option_strings or action.dest}: no help"
        if action.option_strings and not any(action.default is unset for unset in (None, False, argparse.SUPPRESS)):
            assert "default" in parser._get_formatter()._format_action(action), (name, action.option_strings)
    assert "--quiet" in text and "--debug" in text


@pytest.mark.parametrize("name, flag, choices", [
    ("compile", "--target", {"cpu", "cuda"}), ("lint", "--target", {"cpu", "cuda"}),
    ("compile", "--dtype", {"float32", "bfloat16", "float16"}), ("init-model", "--family", None),
    ("init-model", "--size", {"tiny", "small", "bench"}), ("serve", "--log-level", None),
])
def test_closed_sets_have_choices(name, flag, choices):
    action = next(a for a in options(COMMANDS[name]) if flag in a.option_strings)
    assert action.choices, (name, flag)
    if choices is not None:
        assert set(action.choices) == choices


def test_version_names_hgc_torch_and_the_gpu_libraries(capsys):
    import torch

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("hgc ") and out[1].startswith(f"torch {torch.__version__}")
    assert {line.split()[0].rstrip(":") for line in out[2:]} == {"triton", "flashinfer", "fla"}


def test_progress_bars_draw_when_asked_and_quiet_turns_them_off(tmp_path):
    from tqdm import tqdm

    from hgc.progress import progress_bars
    from models.loader import init_checkpoint

    assert progress_bars(argparse.Namespace(quiet=True)) is None
    bars = progress_bars(argparse.Namespace(quiet=False))
    assert bars.keywords["disable"] is None  # tqdm's own test: off when stderr is not a terminal
    drawn = io.StringIO()
    init_checkpoint("qwen3_next", "tiny", 0, tmp_path / "ckpt", log=io.StringIO(),
                    progress=functools.partial(tqdm, file=drawn, disable=False, mininterval=0))
    assert "init-model: write" in drawn.getvalue() and "write shards" in drawn.getvalue()
