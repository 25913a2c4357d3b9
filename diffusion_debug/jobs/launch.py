"""``diffusion-debug launch``: an unmodified training script under ``accelerate launch``, with
the training debugger attached in every process (:mod:`~diffusion_debug.jobs.launched`).

The accelerate options are accelerate's own, checked by its own parser before anything starts;
the script becomes an argument of ``-m diffusion_debug.jobs.launched`` and every other option
is passed on as given, so the processes, their environment and the exit code are what
``accelerate launch`` gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from .launched import ENVIRONMENT

BOOTSTRAP = "diffusion_debug.jobs.launched"
OWN_OPTIONS = ("--debug-output-dir", "--debug-config", "--level", "--policy")


def split_arguments(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our options (they come first) and the rest, for accelerate.

    >>> split_arguments(["--level", "extreme", "--num_processes", "2", "train.py", "--lr", "1"])
    ({'level': 'extreme'}, ['--num_processes', '2', 'train.py', '--lr', '1'])
    """
    own: dict[str, str] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in OWN_OPTIONS:
            break
        if not eq:
            if i + 1 >= len(argv):
                raise DiffusionDebugError(f"launch: {name} needs a value.")
            value, i = argv[i + 1], i + 1
        own[name.removeprefix("--").removeprefix("debug-").replace("-", "_")] = value
        i += 1
    return own, argv[i:]


def accelerate_command(rest: list[str]) -> tuple[list[str], str]:
    """The ``accelerate launch`` command line that runs the script under the bootstrap, and the
    script's name; accelerate's own parser checks the options (its error is its usage line)."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def refuse(message: str) -> None:
        raise DiffusionDebugError(f"launch: {message} (accelerate launch's options, then SCRIPT).")

    parser.error = refuse  # one line of ours, not accelerate's usage and exit
    parsed = parser.parse_args(rest)
    script_at = len(rest) - len(parsed.training_script_args) - 1
    options, script, script_args = rest[:script_at], rest[script_at], rest[script_at + 1 :]
    if parsed.no_python:
        raise DiffusionDebugError(
            "launch: --no_python runs a program that is not Python, so the debugger cannot attach to it; "
            "use accelerate launch directly."
        )
    options = [o for o in options if o not in ("-m", "--module")]
    bootstrap = [*options, "--module", BOOTSTRAP, *(["--module"] if parsed.module else []), script, *script_args]
    return [sys.executable, "-m", "accelerate.commands.launch", *bootstrap], script


def check_settings(own: dict[str, str]) -> dict[str, Any]:
    """Our settings, checked before any process starts (one sentence when wrong)."""
    from ..config import DebugConfig, read_config_file
    from .pipeline_loading import check_output_dir

    data = read_config_file(Path(own["config"])) if own.get("config") else {}
    for key in ("level", "policy", "output_dir"):
        if own.get(key):
            data[key] = own[key]
    config = DebugConfig.from_dict(data)
    check_output_dir(config.output_dir)
    settings = {k: v for k, v in own.items() if k != "config"}
    if own.get("config"):
        settings["config"] = str(Path(own["config"]).resolve())
    settings["output_dir"] = str(Path(config.output_dir).resolve())
    return settings


def run_launch(argv: list[str]) -> int:
    own, rest = split_arguments(argv)
    command, _ = accelerate_command(rest)  # accelerate's options first: they create nothing
    settings = check_settings(own)
    environment = dict(os.environ, **{ENVIRONMENT: json.dumps(settings)})
    returncode = subprocess.run(command, env=environment).returncode
    return returncode if returncode >= 0 else 128 - returncode
