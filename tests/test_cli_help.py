"""``diffusion-debug COMMAND --help``: a description for every command, help on every option, the
defaults shown, and only the choices a command accepts."""

from __future__ import annotations

import argparse

import pytest

from diffusion_debug.cli import build_parser, main
from diffusion_debug.jobs.cli_arguments import COMMAND_DESCRIPTIONS

COMMANDS = (
    "demo",
    "run",
    "train",
    "launch",
    "doctor",
    "report",
    "inspect",
    "replay",
    "why",
    "diff",
    "compare",
    "serve",
    "export",
)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps to the terminal


def test_every_command_is_described():
    assert sorted(_subparsers()) == sorted(COMMANDS) == sorted(COMMAND_DESCRIPTIONS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_the_description_and_each_option_with_its_default(capsys, command):
    text = _help(capsys, command)
    first_paragraph = COMMAND_DESCRIPTIONS[command].split("\n\n")[0]
    assert " ".join(first_paragraph.split()) in text
    for action in _subparsers()[command]._actions:
        assert action.help, f"{command} {action.dest} has no help"
        if action.default in (None, argparse.SUPPRESS) or action.default is False or action.default == []:
            continue  # nothing worth showing
        if "default" not in action.help:  # a help that says its default in its own words keeps them
            assert f"{' '.join(action.help.split())} (default: {action.default})" in text


def test_help_shows_the_defaults_a_newcomer_asks_about(capsys):
    run = _help(capsys, "run")
    assert "denoising steps (default: 20)" in run
    assert "the prompt (default: a photo of an astronaut riding a horse)" in run
    serve = _help(capsys, "serve")
    assert "the output directory whose runs it serves (default: debug_output)" in serve
    assert "(default 0: a free one, printed)" in serve


def test_run_offers_only_the_policies_a_pipeline_can_take(capsys):
    assert "--policy {record,warn,raise,stop}" in _help(capsys, "run")
    assert "--policy {record,warn,skip,raise,stop}" in _help(capsys, "train")  # an optimizer step can be skipped
    with pytest.raises(SystemExit) as exited:
        main(["run", "--policy", "skip"])
    assert exited.value.code == 2
    assert "argument --policy: invalid choice: 'skip'" in capsys.readouterr().err


def test_version_is_one_line_with_the_libraries_under_it(capsys):
    import platform

    import diffusers
    import torch

    import diffusion_debug

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"diffusion-debug {diffusion_debug.__version__} (python {platform.python_version()}, "
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
    )
    assert out.endswith(f"cuda {torch.version.cuda or 'none'})\n") and out.count("\n") == 1
